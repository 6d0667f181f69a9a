//! The on-disk format: the manifest (JSON) and the per-rank shard files (binary).
//!
//! A rank file is `BFPPSHRD`, a little-endian `u32` header length, a JSON [`RankHeader`], then
//! for every stage in the header's order its owned parameters, first moment and second moment
//! as little-endian `f32`. The manifest lists every rank file with its size and CRC-32, so a
//! truncated or corrupted file is named before anything is loaded from it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::CheckpointError;
use crate::data::DataPosition;
use crate::engine::{RankState, ScalerState, ShardLayout, StageState};

/// Format version written into every manifest; a reader refuses any other.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// First bytes of every rank file.
const MAGIC: &[u8; 8] = b"BFPPSHRD";

/// The file name of world rank `rank`'s shards.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.bin")
}

/// The parallel layout a checkpoint was written under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// Pipeline ranks P.
    pub pp: usize,
    /// Stages per pipeline rank V.
    pub loops: usize,
    /// Data-parallel replicas D.
    pub dp: usize,
    /// ZeRO level (0–3).
    pub zero: u8,
    /// Schedule family, as text (informative).
    pub schedule: String,
    /// Every stage in global order.
    pub stages: Vec<SavedStage>,
}

/// One stage of the saved layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedStage {
    /// Real (unpadded) parameter values of the stage.
    pub numel: usize,
    /// Pipeline rank that held it.
    pub pp_rank: usize,
}

/// One float parameter of the model, in the model's global flattening order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    /// Module path, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type of the stored values (always `f32`: master weights and moments).
    pub dtype: String,
}

/// One rank file with what it must hash to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// World rank.
    pub rank: usize,
    /// File name inside the step directory.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the whole file, as 8 hex digits.
    pub crc32: String,
}

/// Everything that describes a checkpoint; written last, so its presence means completeness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: usize,
    /// The layout it was written under.
    pub layout: SavedLayout,
    /// The model's configuration (compared on load: another model is refused).
    pub model: serde_json::Value,
    /// Every float parameter in global order.
    pub params: Vec<ParamEntry>,
    /// AdamW steps taken (the bias-correction counter; equal on every shard).
    pub optimizer_steps: usize,
    /// The learning-rate schedule (its position is `step`).
    pub lr_schedule: serde_json::Value,
    /// Where the data stream stands (None for callers without a [`crate::data::Batcher`]).
    pub data: Option<DataPosition>,
    /// Seed of the model initialisation and of the data order; the engine draws no other
    /// random numbers (no dropout during pipelined training), so this is the whole RNG state.
    pub seed: u64,
    /// The rank files.
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// Total parameter values of the model.
    pub fn numel(&self) -> usize {
        self.layout.stages.iter().map(|s| s.numel).sum()
    }
}

/// Header of a rank file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct RankHeader {
    pub(super) rank: usize,
    pub(super) step: usize,
    pub(super) stages: Vec<StageHeader>,
    /// The f16 loss scale and its good-step count; absent without loss scaling (and in
    /// files written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    loss_scale: Option<(f64, usize)>,
}

/// A rank file's header, as [`super::reader`] reads it.
pub(super) type FileHeader = RankHeader;

impl RankHeader {
    /// The f16 loss scale saved in this file, if any.
    pub(super) fn scaler(&self) -> Option<ScalerState> {
        self.loss_scale
            .map(|(scale, good_steps)| ScalerState { scale, good_steps })
    }
}

/// One stage's entry in a rank file header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct StageHeader {
    pub(super) stage: usize,
    numel: usize,
    padded: usize,
    dp: usize,
    dp_index: usize,
    sharded: bool,
    optimizer_steps: usize,
}

impl StageHeader {
    /// The saved stage's layout.
    pub(super) fn layout(&self) -> ShardLayout {
        ShardLayout {
            numel: self.numel,
            padded: self.padded,
            dp: self.dp,
            dp_index: self.dp_index,
            sharded: self.sharded,
        }
    }
}

/// Reads the header of the rank file `file` (named `path` in errors): the header and the
/// byte offset of the first value after it.
pub(super) fn read_header(
    path: &Path,
    file: &mut impl std::io::Read,
) -> Result<(RankHeader, u64), CheckpointError> {
    let bad = |problem: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        problem,
    };
    let mut start = [0u8; 12];
    file.read_exact(&mut start)
        .map_err(|e| bad(format!("no header: {e}")))?;
    if &start[..8] != MAGIC {
        return Err(bad("not a bfpp shard file (bad magic)".into()));
    }
    let header_len = u32::from_le_bytes([start[8], start[9], start[10], start[11]]) as usize;
    let mut json = vec![0u8; header_len];
    file.read_exact(&mut json)
        .map_err(|_| bad("truncated header".into()))?;
    let header: RankHeader =
        serde_json::from_slice(&json).map_err(|e| bad(format!("unreadable header: {e}")))?;
    Ok((header, 12 + header_len as u64))
}

/// CRC-32 (IEEE) of everything `reader` yields, as 8 hex digits, read a megabyte at a time.
pub(super) fn crc32_hasher_hex(reader: &mut impl std::io::Read) -> std::io::Result<String> {
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(format!("{:08x}", hasher.finalize()))
}

/// Serialises one rank's state.
pub fn encode_rank(rank: usize, state: &RankState) -> Result<Vec<u8>, CheckpointError> {
    let header = RankHeader {
        rank,
        step: state.step,
        stages: state
            .stages
            .iter()
            .map(|s| StageHeader {
                stage: s.stage,
                numel: s.layout.numel,
                padded: s.layout.padded,
                dp: s.layout.dp,
                dp_index: s.layout.dp_index,
                sharded: s.layout.sharded,
                optimizer_steps: s.optimizer_steps,
            })
            .collect(),
        loss_scale: state.scaler.map(|s| (s.scale, s.good_steps)),
    };
    let json = serde_json::to_vec(&header).map_err(|e| CheckpointError::Encode(e.to_string()))?;
    let header_len = u32::try_from(json.len())
        .map_err(|_| CheckpointError::Encode("rank header over 4 GiB".into()))?;
    let values: usize = state.stages.iter().map(|s| 3 * s.owned.len()).sum();
    let mut out = Vec::with_capacity(12 + json.len() + 4 * values);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&json);
    for s in &state.stages {
        for v in [&s.owned, &s.moment_1, &s.moment_2] {
            out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
    }
    Ok(out)
}

/// Parses a rank file written by [`encode_rank`]; `path` only names the file in errors.
pub fn decode_rank(path: &Path, bytes: &[u8]) -> Result<(usize, RankState), CheckpointError> {
    let bad = |problem: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        problem,
    };
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(bad("not a bfpp shard file (bad magic)".into()));
    }
    let mut len4 = [0u8; 4];
    len4.copy_from_slice(&bytes[8..12]);
    let header_len = u32::from_le_bytes(len4) as usize;
    let body = &bytes[12..];
    if body.len() < header_len {
        return Err(bad("truncated header".into()));
    }
    let header: RankHeader = serde_json::from_slice(&body[..header_len])
        .map_err(|e| bad(format!("unreadable header: {e}")))?;
    let mut data = &body[header_len..];
    let mut stages = Vec::with_capacity(header.stages.len());
    for h in header.stages {
        let layout = ShardLayout {
            numel: h.numel,
            padded: h.padded,
            dp: h.dp,
            dp_index: h.dp_index,
            sharded: h.sharded,
        };
        let len = layout.owned_len();
        let mut take = || -> Result<Vec<f32>, CheckpointError> {
            let n = len * 4;
            if data.len() < n {
                return Err(bad(format!("stage {}: values truncated", h.stage)));
            }
            let (head, rest) = data.split_at(n);
            data = rest;
            Ok(head
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let (owned, moment_1, moment_2) = (take()?, take()?, take()?);
        stages.push(StageState {
            stage: h.stage,
            layout,
            owned,
            moment_1,
            moment_2,
            optimizer_steps: h.optimizer_steps,
        });
    }
    if !data.is_empty() {
        return Err(bad(format!("{} trailing bytes", data.len())));
    }
    Ok((
        header.rank,
        RankState {
            step: header.step,
            stages,
            scaler: header
                .loss_scale
                .map(|(scale, good_steps)| ScalerState { scale, good_steps }),
        },
    ))
}

/// CRC-32 (IEEE) of `bytes` as 8 hex digits.
pub fn crc32_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}
