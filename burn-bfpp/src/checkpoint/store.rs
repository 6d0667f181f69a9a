//! Crash-safe writing and verified reading of checkpoint directories.
//!
//! A run directory holds `step-NNNNNNNN/` directories. Ranks write into
//! `step-NNNNNNNN.partial/` (each file to a temporary name, fsync, rename, fsync of the
//! directory); rank 0 then writes the manifest the same way and renames the whole directory to
//! its final name. So a final-named directory is complete by construction, and a crash at any
//! moment leaves at most a `.partial` directory that loaders ignore and the next save of that
//! step replaces. Old checkpoints are pruned only after a new one is complete.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::format::{
    crc32_hex, decode_rank, encode_rank, rank_file_name, FileEntry, Manifest, FORMAT_VERSION,
    MANIFEST,
};
use super::CheckpointError;
use crate::data::DataPosition;
use crate::engine::{CheckpointSink, RankState};

/// Environment variable that makes a save panic after this many rank files were written
/// (counted over the whole process): the test hook for "a crash between two shard writes".
pub const CRASH_ENV: &str = "BFPP_CKPT_CRASH_AFTER_FILES";

/// The final directory name of the checkpoint of `step`.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn io_err(path: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// fsync a directory so a rename inside it survives a power loss.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, e))
}

/// Write `bytes` to `dir/name` atomically: temporary name, fsync, rename, fsync of `dir`.
pub fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let path = dir.join(name);
    let mut f = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io_err(&tmp, e))?;
    f.sync_all().map_err(|e| io_err(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|e| io_err(&path, e))?;
    sync_dir(dir)
}

/// The complete checkpoints of a run directory, oldest first, as (step, directory).
pub fn list_checkpoints(run_dir: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(run_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(run_dir, e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(run_dir, e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if entry.path().join(MANIFEST).is_file() {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// `path` if it is a step directory (it has a manifest), else the newest complete checkpoint
/// of the run directory `path`.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        return Err(CheckpointError::NotFound(path.to_path_buf()));
    }
    list_checkpoints(path)?
        .pop()
        .map(|(_, dir)| dir)
        .ok_or_else(|| CheckpointError::NotFound(path.to_path_buf()))
}

/// A verified checkpoint: its manifest and every rank's state.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The step directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Every rank's state, by world rank.
    pub ranks: Vec<RankState>,
}

/// Read and verify a checkpoint (`path`: a step directory or a run directory, see
/// [`resolve`]): the manifest's version, every listed file's presence, size and CRC-32, and
/// that each file holds the rank and step the manifest says.
pub fn load(path: &Path) -> Result<Loaded, CheckpointError> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    let world = manifest.layout.pp * manifest.layout.dp;
    let mut ranks: Vec<Option<RankState>> = vec![None; world];
    for entry in &manifest.files {
        let path = dir.join(&entry.file);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(CheckpointError::MissingFile(path))
            }
            Err(e) => return Err(io_err(&path, e)),
        };
        let corrupt = |problem| CheckpointError::Corrupt {
            path: path.clone(),
            problem,
        };
        if bytes.len() as u64 != entry.bytes {
            return Err(corrupt(format!(
                "{} bytes, the manifest says {}",
                bytes.len(),
                entry.bytes
            )));
        }
        let crc = crc32_hex(&bytes);
        if crc != entry.crc32 {
            return Err(corrupt(format!(
                "checksum {crc} does not match the manifest's {}",
                entry.crc32
            )));
        }
        let (rank, state) = decode_rank(&path, &bytes)?;
        if rank != entry.rank || state.step != manifest.step || rank >= world {
            return Err(corrupt(format!(
                "holds rank {rank} at step {}, the manifest says rank {} at step {}",
                state.step, entry.rank, manifest.step
            )));
        }
        ranks[rank] = Some(state);
    }
    let ranks = ranks
        .into_iter()
        .enumerate()
        .map(|(r, s)| s.ok_or_else(|| CheckpointError::MissingFile(dir.join(rank_file_name(r)))))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Loaded {
        dir,
        manifest,
        ranks,
    })
}

/// The manifest of the step directory `dir`, refused unless this build reads its format.
pub(super) fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest_path = dir.join(MANIFEST);
    let text = fs::read(&manifest_path).map_err(|e| io_err(&manifest_path, e))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| CheckpointError::Corrupt {
            path: manifest_path.clone(),
            problem: format!("unreadable manifest: {e}"),
        })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(CheckpointError::Corrupt {
            path: manifest_path,
            problem: format!(
                "format version {} (this build reads {FORMAT_VERSION})",
                manifest.format_version
            ),
        });
    }
    Ok(manifest)
}

/// The data position after a number of steps (see [`crate::data::Batcher::position`]).
pub type DataAt<'a> = Box<dyn Fn(u64) -> DataPosition + Sync + 'a>;

/// Writes checkpoints of a run into a run directory: the engine's [`CheckpointSink`].
pub struct DirSink<'a> {
    run_dir: PathBuf,
    /// The manifest's fields that do not change between saves (`step`, `files`, `data` and
    /// `optimizer_steps` are filled at commit).
    template: Manifest,
    /// Data position after a given number of steps.
    data_at: Option<DataAt<'a>>,
    /// Complete checkpoints to keep (0: all).
    keep: usize,
    /// Files written per step, filled by the ranks, read at commit.
    written: Mutex<HashMap<usize, Vec<FileEntry>>>,
    /// Optimizer steps per saved step, for the manifest.
    optimizer_steps: Mutex<HashMap<usize, usize>>,
    /// Test hook: panic after this many rank files ([`CRASH_ENV`]).
    crash_after: Option<usize>,
    files_written: Mutex<usize>,
}

impl std::fmt::Debug for DirSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirSink")
            .field("run_dir", &self.run_dir)
            .field("keep", &self.keep)
            .finish()
    }
}

impl<'a> DirSink<'a> {
    /// A sink writing into `run_dir` with the manifest fields of `template`, keeping the
    /// newest `keep` complete checkpoints (0: all). `data_at(steps)` gives the data position
    /// after `steps` steps.
    pub fn new(
        run_dir: &Path,
        template: Manifest,
        data_at: Option<DataAt<'a>>,
        keep: usize,
    ) -> Result<Self, CheckpointError> {
        fs::create_dir_all(run_dir).map_err(|e| io_err(run_dir, e))?;
        let crash_after = std::env::var(CRASH_ENV)
            .ok()
            .and_then(|v| v.trim().parse().ok());
        Ok(DirSink {
            run_dir: run_dir.to_path_buf(),
            template,
            data_at,
            keep,
            written: Mutex::new(HashMap::new()),
            optimizer_steps: Mutex::new(HashMap::new()),
            crash_after,
            files_written: Mutex::new(0),
        })
    }

    /// Test hook: panic after `files` rank files (over this sink's life), like a crash between
    /// two shard writes; overrides [`CRASH_ENV`].
    pub fn with_crash_after(mut self, files: Option<usize>) -> Self {
        self.crash_after = files;
        self
    }

    /// Refuse to start a run that would overwrite a complete checkpoint: any of `steps`
    /// already saved in the run directory.
    pub fn check_free(
        &self,
        steps: impl IntoIterator<Item = usize>,
    ) -> Result<(), CheckpointError> {
        for step in steps {
            let dir = self.run_dir.join(step_dir_name(step));
            if dir.join(MANIFEST).is_file() {
                return Err(CheckpointError::WouldOverwrite(dir));
            }
        }
        Ok(())
    }

    fn partial_dir(&self, step: usize) -> PathBuf {
        self.run_dir
            .join(format!("{}.partial", step_dir_name(step)))
    }

    fn write_rank_file(&self, rank: usize, state: &RankState) -> Result<(), CheckpointError> {
        let dir = self.partial_dir(state.step);
        fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        let bytes = encode_rank(rank, state)?;
        let file = rank_file_name(rank);
        write_atomic(&dir, &file, &bytes)?;
        let entry = FileEntry {
            rank,
            file,
            bytes: bytes.len() as u64,
            crc32: crc32_hex(&bytes),
        };
        lock(&self.written)
            .entry(state.step)
            .or_default()
            .push(entry);
        let opt = state.stages.first().map_or(0, |s| s.optimizer_steps);
        lock(&self.optimizer_steps).insert(state.step, opt);
        let mut count = lock(&self.files_written);
        *count += 1;
        if self.crash_after == Some(*count) {
            drop(count);
            panic!(
                "{CRASH_ENV}: injected crash after {} rank files",
                *lock(&self.files_written)
            );
        }
        Ok(())
    }

    fn commit_step(&self, step: usize) -> Result<(), CheckpointError> {
        let partial = self.partial_dir(step);
        let mut files = lock(&self.written).remove(&step).unwrap_or_default();
        files.sort_by_key(|f| f.rank);
        let world = self.template.layout.pp * self.template.layout.dp;
        if files.len() < world {
            files = self.files_of_other_processes(&partial, files, world)?;
        }
        let mut manifest = self.template.clone();
        manifest.step = step;
        manifest.files = files;
        manifest.optimizer_steps = lock(&self.optimizer_steps).remove(&step).unwrap_or(0);
        manifest.data = self.data_at.as_ref().map(|f| f(step as u64));
        let json = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| CheckpointError::Encode(e.to_string()))?;
        write_atomic(&partial, MANIFEST, &json)?;
        let target = self.run_dir.join(step_dir_name(step));
        if target.exists() {
            return Err(CheckpointError::WouldOverwrite(target));
        }
        fs::rename(&partial, &target).map_err(|e| io_err(&target, e))?;
        sync_dir(&self.run_dir)?;
        self.prune()
    }

    /// Complete `files` (those this process wrote) with the rank files of the other ranks of
    /// a `world`, written by other processes (ranks as MPI processes): the engine only
    /// commits after every rank reported its file durably written, so each is read back from
    /// the partial directory for its size and checksum. A file rank 0 cannot see means the
    /// run directory is not shared by all ranks, which a checkpoint needs.
    fn files_of_other_processes(
        &self,
        partial: &Path,
        mut files: Vec<FileEntry>,
        world: usize,
    ) -> Result<Vec<FileEntry>, CheckpointError> {
        for rank in 0..world {
            if files.iter().any(|f| f.rank == rank) {
                continue;
            }
            let file = rank_file_name(rank);
            let path = partial.join(&file);
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::Mismatch(format!(
                        "rank {rank} reported writing `{}` but rank 0 does not see it; \
                         --save needs a directory every rank shares (a shared file system \
                         on several nodes)",
                        path.display()
                    )))
                }
                Err(e) => return Err(io_err(&path, e)),
            };
            files.push(FileEntry {
                rank,
                file,
                bytes: bytes.len() as u64,
                crc32: crc32_hex(&bytes),
            });
        }
        files.sort_by_key(|f| f.rank);
        Ok(files)
    }

    /// Delete all but the newest `keep` complete checkpoints (called after a save completed).
    fn prune(&self) -> Result<(), CheckpointError> {
        if self.keep == 0 {
            return Ok(());
        }
        let all = list_checkpoints(&self.run_dir)?;
        let excess = all.len().saturating_sub(self.keep);
        for (_, dir) in all.into_iter().take(excess) {
            // Remove the manifest first: a crash mid-delete leaves an incomplete directory,
            // which loaders ignore, never a manifest whose files are gone.
            let manifest = dir.join(MANIFEST);
            fs::remove_file(&manifest).map_err(|e| io_err(&manifest, e))?;
            sync_dir(&dir)?;
            fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        }
        Ok(())
    }
}

/// Lock a mutex, recovering from poisoning: the data (lists of written files) stays valid
/// if another rank panicked while holding it.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CheckpointSink for DirSink<'_> {
    fn write_rank(&self, rank: usize, state: &RankState) -> Result<(), String> {
        self.write_rank_file(rank, state).map_err(|e| e.to_string())
    }

    fn commit(&self, step: usize) -> Result<(), String> {
        self.commit_step(step).map_err(|e| e.to_string())
    }
}
