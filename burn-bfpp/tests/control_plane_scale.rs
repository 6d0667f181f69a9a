//! The control plane of GPU processes at scale: 256 ranks, each a process of this machine
//! (this test binary, filtered to the ignored [`control_rank_process`]), join one world over
//! [`ControlComm`] as `bfpp launch` or torchrun would start them (their variables and the
//! job's secret), run a barrier, and report how many threads and sockets they hold: a small
//! constant each, where a full mesh would need 255 connections and 510 threads per process.
//! Then one rank whose subtree is not empty is killed (SIGKILL), and every other rank's next
//! barrier must fail at once naming it, including the ranks the control tree reached only
//! through it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn_bfpp::comm::{
    CommConfig, Communicator, ControlComm, Group, RankGrid, RendezvousEnv, JOB_SECRET_ENV,
};

/// Ranks in the world.
const WORLD: usize = 256;
/// The rank killed: rank 0's child, parent of ranks 21-24 and, below them, 85-100 and more.
const VICTIM: usize = 5;
/// Most threads a rank process may hold: its connections' readers and writers (at most five
/// connections), the test harness's threads and, on rank 0, the store.
const MAX_THREADS: usize = 16;
/// Most sockets a rank process may hold (each connection is three handles: the stream and the
/// reader's and writer's clones; plus rank 0's store listener).
const MAX_SOCKETS: usize = 16;
/// Where the ranks write their reports (the variable the rank processes read).
const DIR_ENV: &str = "BFPP_TEST_CONTROL_DIR";
/// Longest the world may take to start and pass its first barrier on a loaded 2-core machine.
const START_LIMIT: Duration = Duration::from_secs(90);
/// Longest the ranks may take to stop once one was killed.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// One rank of the world: connects, passes a barrier, reports its counts, waits for the `go`
/// file, then reports how its second barrier ended.
#[test]
#[ignore = "a rank process, started by a_world_of_256_control_processes_starts_and_names_a_killed_rank"]
fn control_rank_process() {
    let dir = PathBuf::from(std::env::var(DIR_ENV).expect("started by the world test"));
    let env = RendezvousEnv::from_env()
        .expect("launcher variables")
        .expect("RANK is set");
    // One line per event, appended: the test reads the file while this rank runs.
    let report = |line: String| {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("rank-{}.txt", env.rank)))
            .expect("report file");
        std::io::Write::write_all(&mut file, (line + "\n").as_bytes()).expect("report");
    };
    let grid = RankGrid::new(1, env.world_size).expect("grid");
    let config = CommConfig::with_timeout(START_LIMIT);
    let start = Instant::now();
    let comm = match ControlComm::<Flex>::connect(&env, grid, Default::default(), config) {
        Ok(comm) => comm,
        Err(e) => return report(format!("error {e}")),
    };
    let connected = start.elapsed();
    if let Err(e) = comm.barrier(Group::DataParallel) {
        return report(format!("error {e}"));
    }
    let barrier = start.elapsed() - connected;
    let (threads, sockets) = counts();
    report(format!(
        "ready connect_ms={} barrier_ms={} threads={threads} sockets={sockets}",
        connected.as_millis(),
        barrier.as_millis()
    ));
    let go = dir.join("go");
    let waiting = Instant::now();
    while !go.exists() && waiting.elapsed() < START_LIMIT {
        std::thread::sleep(Duration::from_millis(20));
    }
    report(match comm.barrier(Group::DataParallel) {
        Ok(()) => "after ok".to_string(),
        Err(e) => format!("after error {e}"),
    });
}

/// This process's threads and sockets, as the kernel lists them.
fn counts() -> (usize, usize) {
    let threads = std::fs::read_dir("/proc/self/task").expect("/proc").count();
    let sockets = std::fs::read_dir("/proc/self/fd")
        .expect("/proc")
        .filter_map(Result::ok)
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
        })
        .count();
    (threads, sockets)
}

/// The rank processes; killed if the test ends before they do.
struct World(Vec<Child>);

impl Drop for World {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn report_of(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("rank-{rank}.txt"))).unwrap_or_default()
}

/// The value of `key=` in a report line.
fn field(line: &str, key: &str) -> usize {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in `{line}`"))
}

#[test]
fn a_world_of_256_control_processes_starts_and_names_a_killed_rank() {
    let dir = std::env::temp_dir().join(format!("bfpp-control-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("report directory");
    let exe = std::env::current_exe().expect("test binary path");
    let (master_port, store_port) = (free_port(), free_port());
    let secret = "0123456789abcdef".repeat(4);
    let start = Instant::now();
    let mut world = World(Vec::new());
    for rank in 0..WORLD {
        let log = std::fs::File::create(dir.join(format!("rank-{rank}.log"))).expect("log");
        let child = Command::new(&exe)
            .args([
                "--exact",
                "control_rank_process",
                "--ignored",
                "--test-threads",
                "1",
            ])
            .env(DIR_ENV, &dir)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("LOCAL_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", master_port.to_string())
            .env("BFPP_STORE_PORT", store_port.to_string())
            .env(JOB_SECRET_ENV, &secret)
            .env_remove("BFPP_ADVERTISE_ADDR")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start a rank process");
        world.0.push(child);
    }
    // Every rank connected and passed the barrier.
    let pending = |dir: &Path| -> Vec<usize> {
        (0..WORLD)
            .filter(|&r| !report_of(dir, r).starts_with("ready"))
            .collect()
    };
    loop {
        let left = pending(&dir);
        if left.is_empty() {
            break;
        }
        let errors: Vec<String> = (0..WORLD)
            .map(|r| report_of(&dir, r))
            .filter(|t| t.starts_with("error"))
            .collect();
        assert!(errors.is_empty(), "ranks failed to start: {errors:?}");
        assert!(
            start.elapsed() < START_LIMIT,
            "ranks {left:?} not ready after {:?}; rank {}'s log: {}",
            start.elapsed(),
            left[0],
            std::fs::read_to_string(dir.join(format!("rank-{}.log", left[0]))).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = start.elapsed();
    let lines: Vec<String> = (0..WORLD).map(|r| report_of(&dir, r)).collect();
    let most = |key: &str| lines.iter().map(|l| field(l, key)).max().unwrap_or(0);
    let (threads, sockets) = (most("threads"), most("sockets"));
    let (connect_ms, barrier_ms) = (most("connect_ms"), most("barrier_ms"));
    eprintln!(
        "{WORLD} ranks ready in {started:?} (slowest connect {connect_ms} ms, slowest barrier \
         {barrier_ms} ms); at most {threads} threads and {sockets} sockets in a rank"
    );
    assert!(threads <= MAX_THREADS, "a rank holds {threads} threads");
    assert!(sockets <= MAX_SOCKETS, "a rank holds {sockets} sockets");

    // Kill one rank; the others' next barrier fails naming it.
    world.0[VICTIM].kill().expect("kill the victim");
    world.0[VICTIM].wait().expect("the victim ends");
    let killed = Instant::now();
    std::fs::write(dir.join("go"), b"").expect("go");
    for (rank, child) in world.0.iter_mut().enumerate() {
        loop {
            match child.try_wait().expect("rank status") {
                Some(status) => {
                    assert!(rank == VICTIM || status.success(), "rank {rank}: {status}");
                    break;
                }
                None if killed.elapsed() > STOP_LIMIT => {
                    panic!("rank {rank} still runs {STOP_LIMIT:?} after rank {VICTIM} was killed")
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    let stopped = killed.elapsed();
    eprintln!("every rank stopped {stopped:?} after rank {VICTIM} was killed");
    for rank in (0..WORLD).filter(|&r| r != VICTIM) {
        let text = report_of(&dir, rank);
        let after = text
            .lines()
            .find(|l| l.starts_with("after"))
            .unwrap_or_else(|| panic!("rank {rank} reported no second barrier: {text}"));
        assert!(
            after.starts_with("after error") && after.contains(&format!("rank {VICTIM}")),
            "rank {rank}: {after}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
