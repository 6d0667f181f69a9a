//! A checkpoint's trained weights as safetensors, written one tensor at a time: a model larger
//! than the exporting process's memory exports all the same, into one file or one file per
//! stage with a Hugging Face index (`model.safetensors.index.json`), and both load into plain
//! Burn by name (burn-store's `SafetensorsStore`) and into `bfpp train --init`.
//!
//! The format is written here rather than through the `safetensors` crate: its writer asks
//! each tensor for its bytes through an infallible method, and reading a tensor from the
//! checkpoint can fail (a damaged file), which must stop the export naming the file rather
//! than panic or write a wrong tensor. The layout is the crate's (and the format
//! specification's): an 8-byte little-endian header length, a JSON header padded with spaces
//! to a multiple of 8 bytes, then the tensors' bytes in header order.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::format::ParamEntry;
use super::reader::{CheckpointReader, Vector};
use super::CheckpointError;

/// How `bfpp export` lays out the safetensors it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// One file holding every tensor.
    OneFile,
    /// One file per saved stage, `{stem}-00001-of-0000N.safetensors`, and the index
    /// `{stem}.safetensors.index.json` naming each tensor's file, as Hugging Face writes them.
    PerStage,
}

/// Every parameter of the manifest with its range in the model's flattening order.
fn param_ranges(params: &[ParamEntry]) -> Vec<(&ParamEntry, Range<usize>)> {
    let mut at = 0;
    params
        .iter()
        .map(|p| {
            let n: usize = p.shape.iter().product();
            let range = at..at + n;
            at += n;
            (p, range)
        })
        .collect()
}

/// Writes the trained weights of `reader`'s checkpoint to `out` (a `.safetensors` path) as
/// `sharding` says, one tensor in memory at a time; returns the files written (the index
/// last). Each file is written under a temporary name and renamed when complete, so a
/// failed export leaves no partial file under the final name.
pub fn export_safetensors(
    reader: &CheckpointReader,
    out: &Path,
    sharding: Sharding,
) -> Result<Vec<PathBuf>, CheckpointError> {
    let manifest = reader.manifest();
    let ranges = param_ranges(&manifest.params);
    let total: usize = ranges.last().map_or(0, |(_, r)| r.end);
    if total != manifest.numel() {
        return Err(CheckpointError::Corrupt {
            path: reader.dir().join(super::MANIFEST),
            problem: format!(
                "its parameter list holds {total} values, its stages {}",
                manifest.numel()
            ),
        });
    }
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("producer".to_string(), "bfpp export".to_string()),
        ("step".to_string(), manifest.step.to_string()),
    ]);
    match sharding {
        Sharding::OneFile => {
            write_file(reader, out, &ranges, &metadata)?;
            Ok(vec![out.to_path_buf()])
        }
        Sharding::PerStage => {
            // A stage is a range of whole layers, so a parameter never spans two stages.
            let mut stage_ends = Vec::new();
            let mut at = 0;
            for s in &manifest.layout.stages {
                at += s.numel;
                stage_ends.push(at);
            }
            let files = stage_ends.len();
            let dir = out.parent().unwrap_or(Path::new("."));
            let stem = out
                .file_name()
                .and_then(|n| n.to_str())
                .map(|n| n.trim_end_matches(".safetensors"))
                .filter(|s| !s.is_empty())
                .unwrap_or("model");
            let mut written = Vec::new();
            let mut weight_map = serde_json::Map::new();
            let mut total_size = 0u64;
            let mut first = 0;
            for (i, &end) in stage_ends.iter().enumerate() {
                let name = format!("{stem}-{:05}-of-{files:05}.safetensors", i + 1);
                let stage: Vec<_> = ranges
                    .iter()
                    .filter(|(_, r)| r.start >= first && r.end <= end)
                    .cloned()
                    .collect();
                for (p, r) in &stage {
                    weight_map.insert(p.name.clone(), Value::String(name.clone()));
                    total_size += 4 * r.len() as u64;
                }
                let path = dir.join(&name);
                write_file(reader, &path, &stage, &metadata)?;
                written.push(path);
                first = end;
            }
            let index = json!({
                "metadata": { "total_size": total_size, "step": manifest.step },
                "weight_map": weight_map,
            });
            let index_path = dir.join(format!("{stem}.safetensors.index.json"));
            let text = serde_json::to_string_pretty(&index)
                .map_err(|e| CheckpointError::Encode(e.to_string()))?;
            write_atomically(&index_path, |w| w.write_all(text.as_bytes()))?;
            written.push(index_path);
            Ok(written)
        }
    }
}

/// One safetensors file of `tensors`, each read from the checkpoint when it is written.
fn write_file(
    reader: &CheckpointReader,
    path: &Path,
    tensors: &[(&ParamEntry, Range<usize>)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!(metadata));
    let mut offset = 0usize;
    for (p, r) in tensors {
        let bytes = 4 * r.len();
        header.insert(
            p.name.clone(),
            json!({"dtype": "F32", "shape": p.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut header = serde_json::to_vec(&Value::Object(header))
        .map_err(|e| CheckpointError::Encode(e.to_string()))?;
    header.resize(header.len().div_ceil(8) * 8, b' ');
    let mut failure = None;
    write_atomically(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for (_, r) in tensors {
            let values = match reader.read(Vector::Params, r.clone()) {
                Ok(v) => v,
                Err(e) => {
                    failure = Some(e);
                    return Err(std::io::Error::other("reading the checkpoint failed"));
                }
            };
            for v in values {
                w.write_all(&v.to_le_bytes())?;
            }
        }
        Ok(())
    })
    .map_err(|e| failure.unwrap_or(e))
}

/// Writes `path` through `write` under a temporary name in the same folder, then renames it:
/// the final name only ever holds a complete file.
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let partial = path.with_extension("partial");
    let result = (|| {
        let mut w = BufWriter::new(File::create(&partial)?);
        write(&mut w)?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&partial, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result.map_err(io)
}
