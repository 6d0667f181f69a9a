//! `bfpp launch --nproc N -- train …`: starts N local processes of this binary, one rank each.
//!
//! The processes are started by OpenMPI's `mpirun` (which also wires them together), because
//! ranks on CPU communicate over MPI; as root it needs `--allow-run-as-root`, and more ranks
//! than cores need `--oversubscribe`, both of which are added. The exit status is the first
//! failure: `mpirun` stops the other ranks when one exits non-zero, and each rank's own error
//! names the rank that failed first.

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

/// `bfpp launch [FLAGS] -- COMMAND…`.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Number of processes (must equal pp × dp of the command's layout).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// The launcher to use; default: `mpirun` from PATH.
    #[arg(long, value_name = "PATH")]
    pub mpirun: Option<PathBuf>,
    /// The bfpp command every process runs, e.g. `train --pp 2 --dp 2`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Why `bfpp launch` failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// `--nproc 0`.
    #[error("--nproc must be at least 1")]
    NoProcesses,
    /// No launcher on PATH.
    #[error(
        "`mpirun` was not found on PATH; install OpenMPI (Debian/Ubuntu: `apt-get install \
         openmpi-bin libopenmpi-dev`) or name it with --mpirun"
    )]
    NoMpirun,
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
    /// A rank failed; the ranks' own errors (on standard error) name the one that failed first.
    #[error("{nproc} ranks launched; the run failed with exit status {status} (see the ranks' errors above)")]
    Failed {
        /// Processes launched.
        nproc: usize,
        /// `mpirun`'s exit status.
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
    cmd.arg("--oversubscribe")
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
    let launcher = match &args.mpirun {
        Some(p) => p.clone(),
        None => find_in_path("mpirun").ok_or(LaunchError::NoMpirun)?,
    };
    let exe = std::env::current_exe().map_err(LaunchError::SelfPath)?;
    let status = mpirun_command(&launcher, &exe, args)
        .status()
        .map_err(|source| LaunchError::Spawn {
            launcher: launcher.clone(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(LaunchError::Failed {
            nproc: args.nproc,
            status: status.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_runs_this_binary_n_times_with_the_arguments() {
        let args = LaunchArgs {
            nproc: 4,
            mpirun: None,
            command: vec!["train".into(), "--pp".into(), "2".into()],
        };
        let cmd = mpirun_command(Path::new("/usr/bin/mpirun"), Path::new("/x/bfpp"), &args);
        let argv: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .filter(|a| a != "--allow-run-as-root")
            .collect();
        assert_eq!(
            argv,
            [
                "--oversubscribe",
                "-np",
                "4",
                "/x/bfpp",
                "train",
                "--pp",
                "2"
            ]
        );
        assert!(run(&LaunchArgs { nproc: 0, ..args }).is_err());
    }
}
