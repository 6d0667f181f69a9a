//! Reading a checkpoint by range: a rank reads only the parts of the saved shards that make up
//! its own stages in the new layout, and `bfpp export` one tensor at a time, so no process
//! ever loads the whole checkpoint.
//!
//! A rank file's layout is known from its header (see [`super::format`]): after it, for every
//! stage in header order, its owned values, first moment and second moment, each
//! `owned_len` little-endian `f32`s. A global element (the model's flattening order, which is
//! the concatenation of the stages) lives in exactly one saved shard: the one of its stage's
//! data-parallel rank that owns its offset (any replica's copy, taken from replica 0, at
//! ZeRO-0). Each file is checked against the manifest's size and CRC-32 before its first
//! value is used, streaming, without holding it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::format::{crc32_hasher_hex, read_header, FileHeader, Manifest, MANIFEST};
use super::store::{read_manifest, resolve};
use super::CheckpointError;
use crate::comm::RankGrid;
use crate::engine::{RankState, ResumeSource, ScalerState, ShardLayout, StageState};

/// Which vector of a saved shard to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vector {
    /// The master weights.
    Params,
    /// AdamW's first moment.
    FirstMoment,
    /// AdamW's second moment.
    SecondMoment,
}

impl Vector {
    fn index(self) -> u64 {
        match self {
            Vector::Params => 0,
            Vector::FirstMoment => 1,
            Vector::SecondMoment => 2,
        }
    }
}

/// A verified rank file's header, with where each of its stages' values start.
#[derive(Debug, Clone)]
struct IndexedFile {
    path: PathBuf,
    header: FileHeader,
    /// Byte offset of each header stage's first value.
    starts: Vec<u64>,
}

/// A complete checkpoint on disk, read by range (see the [module docs](self)).
#[derive(Debug)]
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    /// The global offset of every saved stage.
    stage_offsets: Vec<usize>,
    grid: RankGrid,
    /// Rank files whose header was read and whose checksum was verified, by world rank.
    files: Mutex<HashMap<usize, IndexedFile>>,
}

impl CheckpointReader {
    /// Opens the checkpoint at `path` (a step directory, or a run directory: its newest
    /// complete checkpoint): reads the manifest and checks that every rank file it lists is
    /// there with its size. Values and checksums are read only as ranges are asked for.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let dir = resolve(path)?;
        let manifest = read_manifest(&dir)?;
        let layout = &manifest.layout;
        let grid = RankGrid::new(layout.pp, layout.dp).map_err(|e| CheckpointError::Corrupt {
            path: dir.join(MANIFEST),
            problem: format!("its layout is not a grid: {e}"),
        })?;
        for rank in 0..grid.world_size() {
            let entry = manifest
                .files
                .iter()
                .find(|f| f.rank == rank)
                .ok_or_else(|| {
                    CheckpointError::MissingFile(dir.join(super::rank_file_name(rank)))
                })?;
            let file = dir.join(&entry.file);
            let bytes = match std::fs::metadata(&file) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(CheckpointError::MissingFile(file))
                }
                Err(source) => return Err(CheckpointError::Io { path: file, source }),
            };
            if bytes != entry.bytes {
                return Err(CheckpointError::Corrupt {
                    path: file,
                    problem: format!("{bytes} bytes, the manifest says {}", entry.bytes),
                });
            }
        }
        let stage_offsets = layout
            .stages
            .iter()
            .scan(0, |at, s| {
                let start = *at;
                *at += s.numel;
                Some(start)
            })
            .collect();
        Ok(CheckpointReader {
            dir,
            manifest,
            stage_offsets,
            grid,
            files: Mutex::new(HashMap::new()),
        })
    }

    /// The checkpoint's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The step directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The header of world rank `rank`'s file, verified against the manifest (checksum, rank,
    /// step) the first time it is asked for.
    fn file(&self, rank: usize) -> Result<IndexedFile, CheckpointError> {
        let mut files = self
            .files
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = files.get(&rank) {
            return Ok(f.clone());
        }
        let entry = self
            .manifest
            .files
            .iter()
            .find(|f| f.rank == rank)
            .ok_or_else(|| {
                CheckpointError::MissingFile(self.dir.join(super::rank_file_name(rank)))
            })?;
        let path = self.dir.join(&entry.file);
        let corrupt = |problem: String| CheckpointError::Corrupt {
            path: path.clone(),
            problem,
        };
        let io = |source| CheckpointError::Io {
            path: path.clone(),
            source,
        };
        let crc = {
            let mut file = File::open(&path).map_err(io)?;
            crc32_hasher_hex(&mut file).map_err(io)?
        };
        if crc != entry.crc32 {
            return Err(corrupt(format!(
                "checksum {crc} does not match the manifest's {}",
                entry.crc32
            )));
        }
        let mut file = File::open(&path).map_err(io)?;
        let (header, data_start) = read_header(&path, &mut file)?;
        if header.rank != rank || header.step != self.manifest.step {
            return Err(corrupt(format!(
                "holds rank {} at step {}, the manifest says rank {rank} at step {}",
                header.rank, header.step, self.manifest.step
            )));
        }
        let mut starts = Vec::with_capacity(header.stages.len());
        let mut at = data_start;
        for stage in &header.stages {
            starts.push(at);
            at += 3 * 4 * stage.layout().owned_len() as u64;
        }
        if at != entry.bytes {
            return Err(corrupt(format!(
                "its header accounts for {at} bytes, the file has {}",
                entry.bytes
            )));
        }
        let indexed = IndexedFile {
            path,
            header,
            starts,
        };
        files.insert(rank, indexed.clone());
        Ok(indexed)
    }

    /// The values `global` (a range of the model's flattening order) of `vector`.
    pub fn read(&self, vector: Vector, global: Range<usize>) -> Result<Vec<f32>, CheckpointError> {
        let mut out = Vec::with_capacity(global.len());
        let layout = &self.manifest.layout;
        let mut at = global.start;
        while at < global.end {
            // The saved stage holding `at`.
            let t = self
                .stage_offsets
                .partition_point(|&o| o <= at)
                .checked_sub(1)
                .filter(|&t| at < self.stage_offsets[t] + layout.stages[t].numel)
                .ok_or_else(|| {
                    CheckpointError::Mismatch(format!(
                        "element {at} is beyond the checkpoint's {} parameter values",
                        self.manifest.numel()
                    ))
                })?;
            let within = at - self.stage_offsets[t];
            let stage_end = (self.stage_offsets[t] + layout.stages[t].numel).min(global.end);
            // Which replica's file holds it, and where in that replica's shard.
            let file0 = self.file(self.grid.rank_of(layout.stages[t].pp_rank, 0))?;
            let saved = file0
                .header
                .stages
                .iter()
                .find(|s| s.stage == t)
                .map(|s| s.layout())
                .ok_or_else(|| self.missing_stage(&file0, t))?;
            let (dp_index, offset) = if saved.sharded {
                (within / saved.owned_len(), within % saved.owned_len())
            } else {
                (0, within)
            };
            let take = (stage_end - at).min(saved.owned_len() - offset);
            let file = self.file(self.grid.rank_of(layout.stages[t].pp_rank, dp_index))?;
            let position = file
                .header
                .stages
                .iter()
                .position(|s| s.stage == t && s.layout().dp_index == dp_index)
                .ok_or_else(|| self.missing_stage(&file, t))?;
            let start = file.starts[position]
                + 4 * (vector.index() * saved.owned_len() as u64 + offset as u64);
            out.extend(read_f32s(&file.path, start, take)?);
            at += take;
        }
        Ok(out)
    }

    fn missing_stage(&self, file: &IndexedFile, stage: usize) -> CheckpointError {
        CheckpointError::Corrupt {
            path: file.path.clone(),
            problem: format!("the manifest places stage {stage} here, the file does not hold it"),
        }
    }

    /// The loss scale saved with the checkpoint (world rank 0's file), if any.
    pub fn scaler(&self) -> Result<Option<ScalerState>, CheckpointError> {
        Ok(self.file(0)?.header.scaler())
    }
}

/// `count` little-endian f32s of `path` from byte `start`.
fn read_f32s(path: &Path, start: u64, count: usize) -> Result<Vec<f32>, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    file.seek(SeekFrom::Start(start)).map_err(io)?;
    let mut bytes = vec![0u8; 4 * count];
    file.read_exact(&mut bytes).map_err(io)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A checkpoint resharded for a new layout as each rank asks for its own stages: the
/// engine's [`ResumeSource`] for checkpoints on disk. Each rank reads only the values of its
/// own shards.
#[derive(Debug)]
pub struct DirResume {
    reader: CheckpointReader,
    /// The global offset of every stage of the new layout.
    new_offsets: Vec<usize>,
}

impl DirResume {
    /// Resumes `reader`'s checkpoint in a layout whose stages hold `stage_numels` parameter
    /// values each (in stage order); refused unless they hold the checkpoint's values.
    pub fn new(reader: CheckpointReader, stage_numels: &[usize]) -> Result<Self, CheckpointError> {
        let total: usize = stage_numels.iter().sum();
        if total != reader.manifest.numel() {
            return Err(CheckpointError::Mismatch(format!(
                "the new layout's stages hold {total} values, the checkpoint `{}` {}",
                reader.dir.display(),
                reader.manifest.numel()
            )));
        }
        let new_offsets = stage_numels
            .iter()
            .scan(0, |at, n| {
                let start = *at;
                *at += n;
                Some(start)
            })
            .collect();
        Ok(DirResume {
            reader,
            new_offsets,
        })
    }

    /// The checkpoint read.
    pub fn reader(&self) -> &CheckpointReader {
        &self.reader
    }

    fn stage_state(
        &self,
        stage: usize,
        layout: ShardLayout,
    ) -> Result<StageState, CheckpointError> {
        let offset = *self.new_offsets.get(stage).ok_or_else(|| {
            CheckpointError::Mismatch(format!(
                "stage {stage} is not a stage of the layout the checkpoint was resharded for"
            ))
        })?;
        let start = layout.owned_offset();
        let real = start.min(layout.numel)..(start + layout.owned_len()).min(layout.numel);
        let global = offset + real.start..offset + real.end;
        let read = |vector| -> Result<Vec<f32>, CheckpointError> {
            let mut v = self.reader.read(vector, global.clone())?;
            // The padding past the stage's values is zeros, which AdamW keeps at zero.
            v.resize(layout.owned_len(), 0.0);
            Ok(v)
        };
        Ok(StageState {
            stage,
            layout,
            owned: read(Vector::Params)?,
            moment_1: read(Vector::FirstMoment)?,
            moment_2: read(Vector::SecondMoment)?,
            optimizer_steps: self.reader.manifest.optimizer_steps,
        })
    }
}

impl ResumeSource for DirResume {
    fn step(&self) -> usize {
        self.reader.manifest.step
    }

    fn rank_state(
        &self,
        _rank: usize,
        stages: &[(usize, ShardLayout)],
    ) -> Result<RankState, String> {
        let states = stages
            .iter()
            .map(|&(s, layout)| self.stage_state(s, layout))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        Ok(RankState {
            step: self.reader.manifest.step,
            stages: states,
            scaler: self.reader.scaler().map_err(|e| e.to_string())?,
        })
    }
}
