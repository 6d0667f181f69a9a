//! [`ControlComm`] on loopback, each rank a thread with its own connections (as it would be a
//! process): the process ranks' message layer gives the same results as [`LocalComm`] bit
//! for bit, failures are reported by rank, and the control channel refuses bulk data.

use std::time::{Duration, Instant};

use super::control::{hello, CONTROL_PURPOSE, MAX_CONTROL_TENSOR_BYTES};
use super::secret::JobSecret;
use super::store::TcpStore;
use super::tests::{tensor1, values, B};
use super::*;

/// A port nobody listens on right now.
fn free_port() -> u16 {
    free_local_port().expect("a free local port")
}

/// The launcher's variables of world rank `rank` of `world_size`.
fn env(rank: usize, world_size: usize, port: u16) -> RendezvousEnv {
    RendezvousEnv::on_this_machine(rank, world_size, port).with_secret(JobSecret::for_tests())
}

/// Connects a `pp × dp` world over TCP, one thread per rank, and runs `f` on every rank;
/// returns each rank's result in world-rank order.
pub(super) fn over_control<T: Send>(
    pp: usize,
    dp: usize,
    timeout: Duration,
    f: impl Fn(&ControlComm<B>) -> Result<T, CommError> + Sync,
) -> Vec<Result<T, CommError>> {
    let grid = RankGrid::new(pp, dp).expect("valid grid");
    let port = free_port();
    let config = CommConfig::with_timeout(timeout);
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (0..grid.world_size())
            .map(|rank| {
                scope.spawn(move || {
                    let e = env(rank, grid.world_size(), port);
                    let comm = ControlComm::<B>::connect(&e, grid, Default::default(), config)?;
                    f(&comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

/// Every operation once, with values that differ per rank: what each rank ends up with.
fn every_operation<C: Communicator<B>>(comm: &C) -> Result<Vec<f32>, CommError> {
    let device = *comm.device();
    let rank = comm.rank();
    // Values whose sums round differently in different orders.
    let mine = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((rank * 7 + i) as f32).sin() * 10f32.powi((i % 5) as i32 - 2))
            .collect()
    };
    let mut out = Vec::new();
    out.extend(values(comm.all_reduce(
        Group::DataParallel,
        tensor1(mine(6), &device),
        ReduceOp::Sum,
    )?));
    out.extend(values(comm.reduce_scatter(
        Group::Pipeline,
        tensor1(mine(8), &device),
        ReduceOp::Mean,
    )?));
    out.extend(values(
        comm.all_gather(Group::DataParallel, tensor1(mine(3), &device))?,
    ));
    out.extend(values(comm.broadcast(
        Group::Pipeline,
        1,
        tensor1(mine(4), &device),
    )?));
    // To the other pipeline rank, two tags received in the other order, and one to itself.
    let grid = comm.grid();
    let peer = grid.rank_of(1 - grid.pp_index(rank), grid.dp_index(rank));
    comm.send(peer, 1, tensor1(mine(2), &device).reshape([1, 2]))?;
    comm.send(peer, 2, tensor1(mine(3), &device))?;
    comm.send(rank, 3, tensor1(mine(1), &device))?;
    out.extend(values(comm.recv::<1>(peer, 2, [3], DType::F32)?));
    out.extend(values(comm.recv::<2>(peer, 1, [1, 2], DType::F32)?));
    out.extend(values(comm.recv::<1>(rank, 3, [1], DType::F32)?));
    comm.barrier(Group::Pipeline)?;
    comm.barrier(Group::DataParallel)?;
    Ok(out)
}

#[test]
fn a_control_world_gives_what_the_in_process_world_gives_bit_for_bit() {
    let control: Vec<Vec<f32>> = over_control(2, 2, Duration::from_secs(20), every_operation)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let grid = RankGrid::new(2, 2).expect("valid grid");
    let local = run_ranks(
        LocalComm::<B>::create(grid, CommConfig::with_timeout(Duration::from_secs(20))),
        every_operation,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    for (rank, (t, l)) in control.iter().zip(&local).enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(t), bits(l), "rank {rank} differs");
    }
    // Spot check against values computed here: rank 0 received rank 1's tag-1 pair.
    let rank1: Vec<f32> = (0..2i32)
        .map(|i| ((7 + i) as f32).sin() * 10f32.powi(i - 2))
        .collect();
    let at = 6 + 4 + 6 + 4 + 3;
    assert_eq!(&control[0][at..at + 2], rank1.as_slice());
}

#[test]
fn a_rank_whose_process_goes_away_is_reported_at_once_not_at_the_timeout() {
    let start = Instant::now();
    let results = over_control(3, 1, Duration::from_secs(60), |comm| {
        let device = *comm.device();
        match comm.rank() {
            // Leaves without sending what rank 1 waits for (its connections close).
            2 => Ok(()),
            1 => comm.recv::<1>(2, 5, [4], DType::F32).map(|_| ()),
            _ => comm
                .all_reduce(Group::Pipeline, tensor1(vec![1.0], &device), ReduceOp::Sum)
                .map(|_| ()),
        }
    });
    let took = start.elapsed();
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(results[2].is_ok());
    assert!(
        matches!(
            &results[1],
            Err(CommError::ConnectionLost {
                rank: 1,
                peer: 2,
                ..
            })
        ),
        "{:?}",
        results[1]
    );
    // Rank 0 is stopped by rank 1's failure (or sees rank 2 gone itself).
    let err = results[0].as_ref().expect_err("rank 0 cannot complete");
    assert!(err.to_string().contains("rank 2"), "{err}");
}

#[test]
fn a_failing_rank_is_named_by_the_others() {
    let results = over_control(2, 2, Duration::from_secs(60), |comm| {
        let device = *comm.device();
        if comm.rank() == 3 {
            comm.abort("out of memory in stage 3");
            return Ok(());
        }
        comm.all_reduce(
            Group::DataParallel,
            tensor1(vec![1.0], &device),
            ReduceOp::Sum,
        )?;
        comm.barrier(Group::Pipeline)
    });
    for (rank, result) in results.iter().enumerate().take(3) {
        let named = matches!(
            result,
            Err(CommError::PeerFailed { failed_rank: 3, cause, .. })
                if cause == "out of memory in stage 3"
        );
        assert!(named, "rank {rank}: {result:?}");
    }
}

#[test]
fn start_up_errors_name_the_problem() {
    let grid = RankGrid::new(2, 2).expect("valid grid");
    let config = CommConfig::with_timeout(Duration::from_millis(600));
    // The launcher started 3 processes for a world of 4.
    let err = ControlComm::<B>::connect(&env(0, 3, free_port()), grid, Default::default(), config)
        .expect_err("world size differs");
    assert!(err.to_string().contains("started 3 processes"), "{err}");
    // Rank 0 of 2 alone: rank 1 never connects.
    let grid = RankGrid::new(2, 1).expect("valid grid");
    let start = Instant::now();
    let err = ControlComm::<B>::connect(&env(0, 2, free_port()), grid, Default::default(), config)
        .expect_err("rank 1 never comes");
    assert!(
        matches!(&err, CommError::Rendezvous { rank: 0, reason } if reason.contains("ranks [1]")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

/// The messages a [`Recorder`] was given, as `(peer, bytes)`, shared with the test.
type Posted = std::rc::Rc<std::cell::RefCell<Vec<(usize, Vec<u8>)>>>;

/// A transport that records what it is given and delivers what the test queued.
#[derive(Default)]
struct Recorder {
    posted: Posted,
    arriving: std::collections::VecDeque<Incoming>,
}

impl Transport for Recorder {
    fn post(&mut self, peer: usize, bytes: Vec<u8>) {
        self.posted.borrow_mut().push((peer, bytes));
    }
    fn poll(&mut self) -> Option<Incoming> {
        self.arriving.pop_front()
    }
    fn sends_in_flight(&mut self) -> bool {
        false
    }
    fn abandon(&mut self) {}
}

#[test]
fn a_failure_learned_from_a_peer_is_passed_on_once_before_this_rank_stops() {
    let posted = std::rc::Rc::default();
    let transport = Recorder {
        posted: std::rc::Rc::clone(&posted),
        arriving: [Incoming::Message {
            from: 2,
            bytes: super::wire::encode_abort(2, "disk full"),
        }]
        .into(),
    };
    let grid = RankGrid::new(4, 1).expect("valid grid");
    let comm = ProcessComm::<B, _>::new(
        grid,
        1,
        Default::default(),
        CommConfig::default(),
        transport,
    );
    let device = *comm.device();
    for _ in 0..2 {
        let err = comm
            .send(3, 0, tensor1(vec![1.0], &device))
            .expect_err("the world has failed");
        assert!(
            matches!(&err, CommError::PeerFailed { failed_rank: 2, cause, .. } if cause == "disk full"),
            "{err}"
        );
    }
    // Every other rank gets the notice naming rank 2, once: ranks 0 and 3 to learn of it,
    // rank 2 as word that this rank knows.
    let recipients: Vec<usize> = posted.borrow().iter().map(|(peer, _)| *peer).collect();
    assert_eq!(recipients, vec![0, 2, 3]);
    let forwarded = posted.borrow()[0].1.clone();
    assert_eq!(forwarded, super::wire::encode_abort(2, "disk full"));
}

/// Rank 1 fails first. Dropping its communicator returns once every peer has passed the
/// failure back (then lingers briefly), or at the timeout when one never does.
#[test]
fn the_rank_that_failed_stays_until_its_peers_have_heard() {
    let drop_time = |heard_from: &[usize]| {
        let transport = Recorder {
            posted: std::rc::Rc::default(),
            arriving: heard_from
                .iter()
                .map(|&from| Incoming::Message {
                    from,
                    bytes: super::wire::encode_abort(1, "out of memory"),
                })
                .collect(),
        };
        let grid = RankGrid::new(4, 1).expect("valid grid");
        let config = CommConfig::with_timeout(Duration::from_secs(2));
        let comm = ProcessComm::<B, _>::new(grid, 1, Default::default(), config, transport);
        comm.abort("out of memory");
        let start = Instant::now();
        drop(comm);
        start.elapsed()
    };
    let all = drop_time(&[0, 2, 3]);
    assert!(
        all < Duration::from_secs(1),
        "all peers heard, yet it stayed {all:?}"
    );
    let missing = drop_time(&[0, 2]);
    assert!(
        missing >= Duration::from_millis(1900) && missing < Duration::from_secs(5),
        "rank 3 never heard: it should stay until the 2 s timeout, stayed {missing:?}"
    );
}

/// Rank 0's control address as rank 1 reads it from the job's store (a world of two).
fn rank0_address(port: u16) -> std::net::SocketAddr {
    let store = TcpStore::connect(&env(1, 2, port), Duration::from_secs(20)).expect("store");
    let published = store
        .get("bfpp/control/address/0")
        .expect("rank 0 publishes");
    String::from_utf8_lossy(&published)
        .parse()
        .expect("an address")
}

#[test]
fn a_stray_connection_at_start_up_does_not_break_the_world() {
    let grid = RankGrid::new(2, 1).expect("valid grid");
    let port = free_port();
    let config = CommConfig::with_timeout(Duration::from_secs(20));
    let results = std::thread::scope(|scope| {
        let rank0 = scope.spawn(move || {
            let comm =
                ControlComm::<B>::connect(&env(0, 2, port), grid, Default::default(), config)?;
            comm.barrier(Group::Pipeline)
        });
        // A client that is not a rank reaches rank 0's published port before rank 1 does.
        let addr = rank0_address(port);
        let mut stray = std::net::TcpStream::connect(addr).expect("the port is open");
        std::io::Write::write_all(&mut stray, b"GET / HTTP/1.0\r\n\r\n").expect("write");
        let rank1 = scope.spawn(move || {
            let comm =
                ControlComm::<B>::connect(&env(1, 2, port), grid, Default::default(), config)?;
            comm.barrier(Group::Pipeline)
        });
        [rank0.join(), rank1.join()].map(|r| r.expect("rank thread"))
    });
    for (rank, result) in results.iter().enumerate() {
        assert!(result.is_ok(), "rank {rank}: {result:?}");
    }
}

/// Rank `rank` of a world of two on the control channel: a barrier, then the sum of every
/// rank's `value`.
fn barrier_and_sum(rank: usize, port: u16, value: f32) -> Result<Vec<f32>, CommError> {
    let grid = RankGrid::new(2, 1).expect("valid grid");
    let config = CommConfig::with_timeout(Duration::from_secs(20));
    let comm = ControlComm::<B>::connect(&env(rank, 2, port), grid, Default::default(), config)?;
    comm.barrier(Group::Pipeline)?;
    let sum = comm.all_reduce(
        Group::Pipeline,
        tensor1(vec![value], comm.device()),
        ReduceOp::Sum,
    );
    sum.map(values)
}

/// A program with another job's secret that greets rank 0 as rank 1, before rank 1 does, is
/// not taken for rank 1: the world forms with the real rank 1 and works.
#[test]
fn a_connection_with_another_jobs_secret_is_not_admitted() {
    let port = free_port();
    let results = std::thread::scope(|scope| {
        let rank0 = scope.spawn(move || barrier_and_sum(0, port, 1.0));
        let addr = rank0_address(port);
        let mut impostor = std::net::TcpStream::connect(addr).expect("the port is open");
        let other = JobSecret::generate().expect("random");
        let answer = other
            .respond(&mut impostor, CONTROL_PURPOSE, Duration::from_secs(20))
            .expect("rank 0 challenges");
        std::io::Write::write_all(&mut impostor, &[&answer[..], &hello(1)].concat())
            .expect("write");
        // Rank 0 hangs up on it.
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut impostor, &mut rest);
        assert!(
            rest.is_empty(),
            "rank 0 sent {} bytes to the impostor",
            rest.len()
        );
        let rank1 = scope.spawn(move || barrier_and_sum(1, port, 2.0));
        [rank0.join(), rank1.join()].map(|r| r.expect("rank thread"))
    });
    for (rank, result) in results.iter().enumerate() {
        assert_eq!(
            result.as_ref().ok(),
            Some(&vec![3.0]),
            "rank {rank}: {result:?}"
        );
    }
}

/// A tensor beyond the control channel's limit is refused with an error saying where data
/// goes instead, and the world stops.
#[test]
fn the_control_channel_refuses_bulk_data() {
    let results = over_control(1, 2, Duration::from_secs(20), |comm| {
        let big = MAX_CONTROL_TENSOR_BYTES / 4 + 1;
        if comm.rank() == 0 {
            comm.send(1, 9, tensor1(vec![0.5; big], comm.device()))
        } else {
            comm.recv::<1>(0, 9, [big], DType::F32).map(drop)
        }
    });
    let sender = results[0].as_ref().expect_err("refused").to_string();
    assert!(
        sender.contains("control channel") && sender.contains("NCCL"),
        "{sender}"
    );
    let receiver = results[1].as_ref().expect_err("stopped").to_string();
    assert!(receiver.contains("rank 0"), "{receiver}");
}
