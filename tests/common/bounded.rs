//! Multi-process launches for tests that can neither hang nor overlap: every launch of a test
//! binary runs alone, in a process group of its own, and is killed (group and all) at its
//! deadline with a failure that shows what the processes printed so far.
//!
//! Shared by the root crate's CLI tests and burn-bfpp's process-rank tests (which include this
//! file by path). A hung `mpirun` once held CI until its 90-minute limit; with these bounds a
//! hang costs one deadline and names itself.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long one launch of a test may take: minutes more than any of them needs on a loaded
/// two-core machine, so that reaching it means a hang.
pub const LAUNCH_DEADLINE: Duration = Duration::from_secs(300);

/// Held for the whole of a launch: launches of one test binary run one at a time, so worlds
/// of processes never compete for the cores (or the ports) of another test's world.
static LAUNCHES: Mutex<()> = Mutex::new(());

/// OpenMPI settings that hold in containers as well as on hosts, applied to every launch
/// (only OpenMPI reads them). Single-copy transfers between ranks (`process_vm_readv`) are
/// refused by container seccomp profiles without `CAP_SYS_PTRACE`; copying through the shared
/// segment instead costs nothing at these sizes.
const OPENMPI_ENV: [(&str, &str); 1] = [("OMPI_MCA_btl_vader_single_copy_mechanism", "none")];

/// How to install `program` when it cannot be started, for the programs tests launch.
fn install_hint(program: &str) -> &'static str {
    if program == "mpirun" {
        "; install OpenMPI: apt-get install openmpi-bin libopenmpi-dev"
    } else {
        ""
    }
}

/// A started process and the threads collecting its standard output and error.
struct Running {
    child: Child,
    stdout: JoinHandle<Vec<u8>>,
    stderr: JoinHandle<Vec<u8>>,
    status: Option<ExitStatus>,
}

fn collect(stream: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut s) = stream {
            // A read error ends the collection; what arrived before it is kept.
            let _ = s.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// A process's standard output followed by its standard error, for failure messages.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Sends `signal` to every process of group `group`; a group already gone is no error.
fn signal_group(group: u32, signal: &str) {
    let _ = Command::new("kill")
        .args(["-s", signal, "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status();
}

/// What a launch left: each process's output, in the order of the commands, and how long the
/// launch ran (from its start, not counting the wait for an earlier launch to end).
pub struct Launched {
    /// Each process's exit status, standard output and standard error.
    pub outputs: Vec<Output>,
    /// From the first process's start to the last one's end.
    pub took: Duration,
}

/// Runs `cmd` to its end like [`Command::output`], alone among this binary's launches, and
/// panics with its output so far if it is still running after `limit`.
pub fn output_within(cmd: Command, limit: Duration) -> Output {
    outputs_within(vec![cmd], limit).outputs.remove(0)
}

/// Starts `cmds` together in one new process group and waits for all of them, as
/// [`output_within`] does for one.
pub fn outputs_within(mut cmds: Vec<Command>, limit: Duration) -> Launched {
    let _alone = LAUNCHES.lock().unwrap_or_else(PoisonError::into_inner);
    let start = Instant::now();
    let mut group = 0u32;
    let mut running = Vec::with_capacity(cmds.len());
    let names: Vec<String> = cmds
        .iter()
        .map(|c| c.get_program().to_string_lossy().into_owned())
        .collect();
    for (cmd, name) in cmds.iter_mut().zip(&names) {
        // Group 0 makes the first process the leader of a new group; the rest join it.
        cmd.process_group(i32::try_from(group).expect("a pid fits in i32"))
            .envs(OPENMPI_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{name}`: {e}{}", install_hint(name)));
        if group == 0 {
            group = child.id();
        }
        let (stdout, stderr) = (collect(child.stdout.take()), collect(child.stderr.take()));
        running.push(Running {
            child,
            stdout,
            stderr,
            status: None,
        });
    }
    let mut timed_out = false;
    while running.iter().any(|r| r.status.is_none()) {
        if start.elapsed() > limit {
            timed_out = true;
            // SIGTERM first lets mpirun take its ranks down; then nothing survives.
            signal_group(group, "TERM");
            std::thread::sleep(Duration::from_secs(5));
            signal_group(group, "KILL");
            for r in &mut running {
                r.status = Some(r.child.wait().expect("a killed process can be waited for"));
            }
            break;
        }
        for r in &mut running {
            if r.status.is_none() {
                r.status = r.child.try_wait().expect("a child's status can be read");
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Whatever the launched processes left running (none should) would hold the pipes open.
    signal_group(group, "KILL");
    let outputs: Vec<Output> = running
        .into_iter()
        .map(|r| Output {
            status: r.status.expect("every process has ended"),
            stdout: r.stdout.join().unwrap_or_default(),
            stderr: r.stderr.join().unwrap_or_default(),
        })
        .collect();
    let took = start.elapsed();
    if timed_out {
        let log: String = outputs.iter().map(output_text).collect();
        panic!(
            "{log}\n^ the output so far of `{}`, which hung: still running after {limit:?}, \
             so its process group was killed",
            names.join("`, `")
        );
    }
    Launched { outputs, took }
}
