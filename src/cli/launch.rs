//! `bfpp launch --nproc N -- train …`: starts N processes of this binary, one rank each, with
//! the transport that fits the ranks:
//!
//! * **CPU ranks** run under OpenMPI's `mpirun`, which starts and wires them (their data moves
//!   over MPI; the build needs `--features mpi`). As root `mpirun` needs
//!   `--allow-run-as-root`, and more ranks than cores need `--oversubscribe`, both added;
//!   `--bind-to none` keeps OpenMPI from pinning each rank to one core (its default for two
//!   ranks or fewer), which would starve a CPU rank's compute threads. `mpirun` stops the
//!   other ranks when one exits non-zero. Several machines: a hostfile, or Slurm's `srun`
//!   (docs/multi-node.md).
//! * **GPU ranks** (`train --backend cuda`) are one process per GPU (local rank → GPU),
//!   started here with torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`, `MASTER_PORT`, `BFPP_STORE_PORT` for the rendezvous store, and the job's
//!   secret `BFPP_JOB_SECRET`, made here or taken from this environment); their
//!   data moves over NCCL and a small TCP control channel carries start-up and failures.
//!   `--nnodes`, `--node-rank` and `--master-*` run one launcher per machine. When a rank
//!   exits with an error the others stop on their own (they are told, or see its control
//!   connection end); any still running after a grace period are killed.
//!
//! Either way the exit status is the first failure, and each rank's own error names the rank
//! that failed first.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use burn_bfpp::comm::{free_local_port, JobSecret, RendezvousEnv, JOB_SECRET_ENV};
use clap::Args;

/// How long ranks still running after the first failure get to stop on their own.
const GRACE: Duration = Duration::from_secs(30);

/// `bfpp launch [FLAGS] -- COMMAND…`.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Number of processes on this machine (the world is nnodes × nproc ranks, pp × dp).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// CPU ranks: the MPI launcher to use; default: `mpirun` from PATH.
    #[arg(long, value_name = "PATH")]
    pub mpirun: Option<PathBuf>,
    /// GPU ranks: machines of the job, each running one `bfpp launch` with the same flags but
    /// its own `--node-rank`; the world is nnodes × nproc ranks.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nnodes: usize,
    /// GPU ranks: this machine's index among the `--nnodes` (its ranks are
    /// node-rank × nproc + 0..nproc).
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub node_rank: usize,
    /// GPU ranks: the address of node 0, where world rank 0 serves the rendezvous store;
    /// default 127.0.0.1 (required with --nnodes above 1).
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// GPU ranks: torchrun's MASTER_PORT on node 0; the store listens one port above it
    /// (BFPP_STORE_PORT overrides); default: free ports (required with --nnodes above 1).
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// The bfpp command every process runs, e.g. `train --pp 2 --dp 2`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// How the ranks of a launch are started, from the command they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// CPU ranks: MPI processes under `mpirun`.
    Mpi,
    /// GPU ranks: one process per GPU started here, with NCCL and a TCP control channel.
    Gpu,
}

impl Ranks {
    /// The ranks `command` runs: GPU ranks for `--backend cuda`, CPU ranks otherwise.
    pub fn of(command: &[String]) -> Self {
        let cuda = command
            .windows(2)
            .any(|w| w[0] == "--backend" && w[1] == "cuda")
            || command.iter().any(|a| a == "--backend=cuda");
        if cuda {
            Ranks::Gpu
        } else {
            Ranks::Mpi
        }
    }
}

/// Why `bfpp launch` failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `--nproc 0`.
    #[error("--nproc must be at least 1")]
    NoProcesses,
    /// Flags that do not fit together.
    #[error("{0}")]
    Flags(String),
    /// No launcher on PATH.
    #[error(
        "CPU ranks as processes run under MPI, and `mpirun` was not found on PATH; install \
         OpenMPI (Debian/Ubuntu: `apt-get install openmpi-bin libopenmpi-dev`) or name it \
         with --mpirun, or run the ranks as threads of one process: the same command \
         without `bfpp launch` (`bfpp train …`)"
    )]
    NoMpirun,
    /// CPU ranks asked for in a build without MPI.
    #[error(
        "CPU ranks as processes run under MPI, and this bfpp was built without it; rebuild \
         with `cargo build --release --features mpi` (needs OpenMPI and libclang: \
         `apt-get install openmpi-bin libopenmpi-dev libclang-dev`), or run the ranks as \
         threads of one process: the same command without `bfpp launch` (`bfpp train …`)"
    )]
    NoMpiBuild,
    /// This binary's own path is unknown.
    #[error("cannot find the bfpp executable to launch: {0}")]
    SelfPath(std::io::Error),
    /// The launcher could not be started.
    #[error("cannot start `{}`: {source}", launcher.display())]
    Spawn {
        /// The launcher.
        launcher: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// The job's secret cannot be made or read.
    #[error("{0}")]
    Secret(String),
    /// No free local port for the ranks' rendezvous.
    #[error("cannot find a free local TCP port for the ranks' rendezvous: {0}")]
    NoPort(std::io::Error),
    /// Waiting for a started process failed.
    #[error("waiting for rank {rank}: {source}")]
    Wait {
        /// The rank's process.
        rank: usize,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// A rank failed; the ranks' own errors (on standard error) name the one that failed first.
    #[error("{nproc} ranks launched; the run failed ({status}; see the ranks' errors above)")]
    Failed {
        /// Processes launched.
        nproc: usize,
        /// The exit status of `mpirun`, or of the first rank that failed.
        status: String,
    },
}

/// Finds `name` in the directories of PATH.
fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Whether this process runs as root (OpenMPI refuses root without a flag).
fn is_root() -> bool {
    // `id -u` would need a process; HOME=/root or USER=root is what OpenMPI's own check
    // amounts to in containers, and the flag is harmless for other users anyway.
    std::env::var("USER").is_ok_and(|u| u == "root")
        || std::env::var_os("HOME").is_some_and(|h| Path::new(&h) == Path::new("/root"))
}

/// The full launcher command line for `args`.
pub fn mpirun_command(launcher: &Path, exe: &Path, args: &LaunchArgs) -> Command {
    let mut cmd = Command::new(launcher);
    if is_root() {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args(["--oversubscribe", "--bind-to", "none"])
        .arg("-np")
        .arg(args.nproc.to_string())
        .arg(exe)
        .args(&args.command);
    cmd
}

/// Runs `bfpp launch`.
pub fn run(args: &LaunchArgs) -> Result<(), LaunchError> {
    if args.nproc == 0 {
        return Err(LaunchError::NoProcesses);
    }
    let exe = std::env::current_exe().map_err(LaunchError::SelfPath)?;
    let failure = match Ranks::of(&args.command) {
        Ranks::Mpi => {
            if args.nnodes != 1 || args.master_addr.is_some() || args.master_port.is_some() {
                return Err(LaunchError::Flags(
                    "--nnodes, --node-rank, --master-addr and --master-port are for GPU ranks \
                     (`train --backend cuda`); CPU ranks on several machines run under one \
                     mpirun with a hostfile, or under srun (see docs/multi-node.md)"
                        .into(),
                ));
            }
            if !cfg!(feature = "mpi") {
                return Err(LaunchError::NoMpiBuild);
            }
            let launcher = match &args.mpirun {
                Some(p) => p.clone(),
                None => find_in_path("mpirun").ok_or(LaunchError::NoMpirun)?,
            };
            let status = mpirun_command(&launcher, &exe, args)
                .status()
                .map_err(|source| LaunchError::Spawn { launcher, source })?;
            (!status.success()).then(|| status.to_string())
        }
        Ranks::Gpu => run_per_gpu(&exe, args)?,
    };
    match failure {
        None => Ok(()),
        Some(status) => Err(LaunchError::Failed {
            nproc: args.nproc,
            status,
        }),
    }
}

/// Where the ranks of this machine find the job's store: `(address, MASTER_PORT, store
/// port)`; checks the multi-node flags.
fn store_of(args: &LaunchArgs) -> Result<(String, u16, u16), LaunchError> {
    let flags = |m: String| Err(LaunchError::Flags(m));
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        return flags(format!(
            "--node-rank {} is not below --nnodes {}: number the machines 0..{}",
            args.node_rank,
            args.nnodes,
            args.nnodes.max(1)
        ));
    }
    let above = |port: u16| {
        port.checked_add(1).ok_or_else(|| {
            LaunchError::Flags(format!(
                "--master-port {port} leaves no port above it for the store"
            ))
        })
    };
    match (&args.master_addr, args.master_port) {
        (Some(addr), Some(port)) => Ok((addr.clone(), port, above(port)?)),
        _ if args.nnodes > 1 => flags(format!(
            "--nnodes {} needs --master-addr and --master-port: the address of node 0 and a \
             free port there, the same on every machine",
            args.nnodes
        )),
        (addr, port) => {
            let (master, store) = match port {
                Some(p) => (p, above(p)?),
                // Ports the system just handed out are free; rank 0 binds the store's again
                // at once (nothing binds MASTER_PORT: it is torchrun's, where there is one).
                None => (
                    free_local_port().map_err(LaunchError::NoPort)?,
                    free_local_port().map_err(LaunchError::NoPort)?,
                ),
            };
            let addr = addr.clone().unwrap_or_else(|| "127.0.0.1".into());
            Ok((addr, master, store))
        }
    }
}

/// The job's secret for the GPU ranks this launch starts: `BFPP_JOB_SECRET` from this
/// environment when set (the same on every machine of a job over several), else a new one
/// for a job on this machine alone.
fn job_secret(
    args: &LaunchArgs,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<JobSecret, LaunchError> {
    match lookup(JOB_SECRET_ENV) {
        Some(text) => JobSecret::from_text(&text).map_err(LaunchError::Secret),
        None if args.nnodes > 1 => Err(LaunchError::Secret(format!(
            "--nnodes {} needs the job's secret, the same on every machine: export \
             {JOB_SECRET_ENV}=$(openssl rand -hex 32) once and pass it to each machine's \
             `bfpp launch` (one machine alone makes its own)",
            args.nnodes
        ))),
        None => JobSecret::generate()
            .map_err(|e| LaunchError::Secret(format!("cannot make the job's secret: {e}"))),
    }
}

/// The command of local rank `local` of this machine, whose job's store is `store` and
/// secret `secret`.
pub fn rank_command(
    exe: &Path,
    args: &LaunchArgs,
    local: usize,
    store: &(String, u16, u16),
    secret: &JobSecret,
) -> Command {
    let place = RendezvousEnv {
        rank: args.node_rank * args.nproc + local,
        world_size: args.nnodes * args.nproc,
        local_rank: local,
        master_addr: store.0.clone(),
        master_port: store.1,
        store_port: store.2,
        secret: Some(secret.clone()),
    };
    let mut cmd = Command::new(exe);
    cmd.args(&args.command)
        .envs(place.vars())
        .env("LOCAL_WORLD_SIZE", args.nproc.to_string());
    cmd
}

/// Starts this machine's GPU ranks with torchrun's variables and waits for them; returns the
/// first failure (`rank R: STATUS`), if any.
fn run_per_gpu(exe: &Path, args: &LaunchArgs) -> Result<Option<String>, LaunchError> {
    let store = store_of(args)?;
    let secret = job_secret(args, |k| std::env::var(k).ok())?;
    let mut children: Vec<Option<Child>> = Vec::with_capacity(args.nproc);
    for local in 0..args.nproc {
        match rank_command(exe, args, local, &store, &secret).spawn() {
            Ok(child) => children.push(Some(child)),
            Err(source) => {
                kill_all(&mut children);
                return Err(LaunchError::Spawn {
                    launcher: exe.to_path_buf(),
                    source,
                });
            }
        }
    }
    let mut first_failure: Option<(Instant, String)> = None;
    loop {
        let mut running = 0;
        for (local, slot) in children.iter_mut().enumerate() {
            let rank = args.node_rank * args.nproc + local;
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    if !status.success() && first_failure.is_none() {
                        first_failure = Some((Instant::now(), describe(rank, status)));
                    }
                }
                Ok(None) => running += 1,
                Err(source) => {
                    kill_all(&mut children);
                    return Err(LaunchError::Wait { rank, source });
                }
            }
        }
        if running == 0 {
            return Ok(first_failure.map(|(_, s)| s));
        }
        if first_failure
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() > GRACE)
        {
            kill_all(&mut children);
            return Ok(first_failure.map(|(_, s)| s));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `rank R: STATUS` for a failed rank.
fn describe(rank: usize, status: ExitStatus) -> String {
    format!("rank {rank}: {status}")
}

/// Kills and reaps the processes still running.
fn kill_all(children: &mut [Option<Child>]) {
    for mut child in children.iter_mut().filter_map(Option::take) {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(command: &[&str]) -> LaunchArgs {
        LaunchArgs {
            nproc: 4,
            mpirun: None,
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            command: command.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn cpu_ranks_run_this_binary_n_times_under_mpirun() {
        let cpu = args(&["train", "--pp", "2"]);
        assert_eq!(Ranks::of(&cpu.command), Ranks::Mpi);
        let cmd = mpirun_command(Path::new("/usr/bin/mpirun"), Path::new("/x/bfpp"), &cpu);
        let argv: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .filter(|a| a != "--allow-run-as-root")
            .collect();
        assert_eq!(
            argv,
            [
                "--oversubscribe",
                "--bind-to",
                "none",
                "-np",
                "4",
                "/x/bfpp",
                "train",
                "--pp",
                "2"
            ]
        );
        assert!(run(&LaunchArgs { nproc: 0, ..cpu }).is_err());
    }

    #[test]
    fn gpu_ranks_get_torchruns_variables_and_a_store_port_of_their_own() {
        for command in [
            &["train", "--backend", "cuda", "--dp", "6"][..],
            &["train", "--backend=cuda", "--dp", "6"][..],
        ] {
            assert_eq!(Ranks::of(&args(command).command), Ranks::Gpu);
        }
        let gpu = LaunchArgs {
            nproc: 3,
            nnodes: 2,
            node_rank: 1,
            master_addr: Some("node0".into()),
            master_port: Some(29_512),
            ..args(&["train", "--backend", "cuda", "--dp", "6"])
        };
        let store = store_of(&gpu).expect("valid flags");
        let shared = "0123456789abcdef0123456789abcdef".to_string();
        let secret = job_secret(&gpu, |k| (k == JOB_SECRET_ENV).then(|| shared.clone()))
            .expect("the exported secret");
        let cmd = rank_command(Path::new("/x/bfpp"), &gpu, 2, &store, &secret);
        let argv: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(argv, ["train", "--backend", "cuda", "--dp", "6"]);
        let env: std::collections::HashMap<String, String> = cmd
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_str()?.to_owned(), v?.to_str()?.to_owned())))
            .collect();
        let lookup = |k: &str| env.get(k).cloned();
        let read = RendezvousEnv::from_lookup(lookup)
            .expect("valid variables")
            .expect("a launch");
        // Machine 1's local rank 2 is world rank 1 × 3 + 2 of 6.
        assert_eq!((read.rank, read.world_size, read.local_rank), (5, 6, 2));
        // The store keeps off MASTER_PORT (torchrun's, under torchrun).
        assert_eq!(
            (read.master_addr.as_str(), read.master_port, read.store_port),
            ("node0", 29_512, 29_513)
        );
        // Every process gets the job's secret; a job over machines needs it exported.
        assert_eq!(read.secret, Some(secret));
        let err = job_secret(&gpu, |_| None)
            .expect_err("two machines")
            .to_string();
        assert!(
            err.contains(JOB_SECRET_ENV) && err.contains("--nnodes 2"),
            "{err}"
        );
        let alone = LaunchArgs {
            nnodes: 1,
            node_rank: 0,
            ..gpu
        };
        let (a, b) = (job_secret(&alone, |_| None), job_secret(&alone, |_| None));
        assert_ne!(a.expect("made"), b.expect("made"), "each job gets its own");
    }

    #[test]
    fn multi_node_flags_are_checked() {
        let one = LaunchArgs {
            nproc: 2,
            ..args(&["train", "--backend", "cuda"])
        };
        let (addr, master, store) = store_of(&one).expect("one machine needs nothing");
        assert_eq!(addr, "127.0.0.1");
        assert_ne!(master, store, "the store does not listen on MASTER_PORT");
        let two = LaunchArgs {
            nnodes: 2,
            ..one.clone()
        };
        let err = store_of(&two).expect_err("no master").to_string();
        assert!(err.contains("--master-addr and --master-port"), "{err}");
        let beyond = LaunchArgs {
            node_rank: 2,
            master_addr: Some("n0".into()),
            master_port: Some(1),
            ..two
        };
        let err = store_of(&beyond).expect_err("node 2 of 2").to_string();
        assert!(err.contains("not below --nnodes 2"), "{err}");
        let cpu = LaunchArgs {
            nnodes: 2,
            ..args(&["train"])
        };
        let err = run(&cpu)
            .expect_err("multi-node flags with MPI")
            .to_string();
        assert!(err.contains("hostfile"), "{err}");
    }
}
