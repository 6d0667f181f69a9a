//! `--attn-tiles`: the attention tile kernels timed under each forced cube shape (and, with
//! `--attn-acc`, each place of their accumulators), so that a GPU run shows which shape and
//! place each kernel should default to (neither is tuned on a GPU yet).

use burn::tensor::DType;
use cubecl_kernels::cube::{
    attention_accumulators, attention_kernel, attention_tile_shapes, attention_uses_tensor_cores,
    set_attention_accumulators, set_attention_kernel, set_attention_tiles, AccumulatorPlace,
    AttentionKernel, TileShape,
};

use super::dev::R;
use super::{fwd_bwd, time_ms, Device, OpInputs};

/// `PxF,PxF,…` (planes × streamed 16-row fragments), each within `1..=TileShape::MAX`.
pub(crate) fn parse_shapes(text: &str) -> Result<Vec<TileShape>, String> {
    text.split(',')
        .map(|item| {
            let bad = || {
                format!(
                    "--attn-tiles: `{item}` is not PLANESxFRAGMENTS with both from 1 to {} \
                     (for example 4x2)",
                    TileShape::MAX
                )
            };
            let (planes, frags) = item.trim().split_once('x').ok_or_else(bad)?;
            let number = |n: &str| n.parse::<usize>().map_err(|_| bad());
            TileShape::new(number(planes)?, number(frags)?).ok_or_else(bad)
        })
        .collect()
}

/// The accumulators' places by the names `--attn-acc` and the JSON rows use.
const PLACES: [(&str, AccumulatorPlace); 2] = [
    ("registers", AccumulatorPlace::Registers),
    ("shared", AccumulatorPlace::Shared),
];

/// `registers,shared` (either or both): where the swept kernels keep their accumulators.
pub(crate) fn parse_places(text: &str) -> Result<Vec<AccumulatorPlace>, String> {
    text.split(',')
        .map(|item| {
            let item = item.trim();
            PLACES
                .iter()
                .find(|(name, _)| *name == item)
                .map(|&(_, place)| place)
                .ok_or_else(|| {
                    format!(
                        "--attn-acc: `{item}` is not a place of the accumulators; give \
                         `registers`, `shared` or `registers,shared`"
                    )
                })
        })
        .collect()
}

/// The place's name as `--attn-acc` spells it.
fn place_label(place: AccumulatorPlace) -> &'static str {
    PLACES
        .iter()
        .find(|&&(_, p)| p == place)
        .map_or("unknown", |&(name, _)| name)
}

/// `PxF` of a shape, or `portable` for a kernel that runs the portable kernel.
fn label(shape: Option<TileShape>) -> String {
    shape.map_or("portable".into(), |s| {
        format!("{}x{}", s.planes, s.stream_frags)
    })
}

/// The shapes the forward, dQ and dK/dV kernels take now, as JSON.
pub(crate) fn shapes_json(device: &Device, dtype: DType, head_dim: usize) -> serde_json::Value {
    let [fwd, dq, dkdv] = attention_tile_shapes::<R>(device, dtype, head_dim).map(label);
    serde_json::json!({ "forward": fwd, "dq": dq, "dkdv": dkdv })
}

/// Forward and forward + backward times (ms) of causal attention on `inputs` under each of
/// `shapes` with the accumulators in each of `places`. On a device without tensor cores the
/// tile kernels are forced (their products
/// then run on the lanes), so the sweep runs on the CPU adapter too. A kernel whose shared
/// memory a shape exceeds runs the portable kernel, which the row's `kernels` names.
pub(crate) fn sweep(
    device: &Device,
    inputs: &OpInputs,
    reps: usize,
    shapes: &[TileShape],
    places: &[AccumulatorPlace],
    dtype: DType,
) -> serde_json::Value {
    let OpInputs::Attention([q, k, v]) = inputs else {
        unreachable!("attention inputs")
    };
    let head_dim = q.dims()[3];
    let previous = attention_kernel();
    let previous_place = attention_accumulators();
    if !attention_uses_tensor_cores::<R>(device, dtype, head_dim) {
        set_attention_kernel(AttentionKernel::Tiles);
    }
    let forward = || {
        let _ = cubecl_kernels::flash_attention(q.clone(), k.clone(), v.clone(), None, true)
            .expect("attention shapes");
    };
    let mut rows = Vec::new();
    for &shape in shapes {
        set_attention_tiles(Some(shape));
        for &place in places {
            set_attention_accumulators(place);
            let kernels = shapes_json(device, dtype, head_dim);
            let fwd = time_ms(device, reps, forward);
            let both = time_ms(device, reps, || fwd_bwd(inputs, true));
            eprintln!(
                "attention tiles {}, accumulators in {}: fwd {fwd:.3} ms, fwd+bwd {both:.3} ms \
                 (forward {}, dQ {}, dK/dV {})",
                label(Some(shape)),
                place_label(place),
                kernels["forward"],
                kernels["dq"],
                kernels["dkdv"],
            );
            rows.push(serde_json::json!({
                "shape": label(Some(shape)),
                "accumulators": place_label(place),
                "fwd": fwd,
                "fwd_bwd": both,
                "kernels": kernels,
            }));
        }
    }
    set_attention_tiles(None);
    set_attention_accumulators(previous_place);
    set_attention_kernel(previous);
    serde_json::Value::Array(rows)
}
