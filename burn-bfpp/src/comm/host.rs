//! Host-side tensor values for collectives: conversion from and to [`TensorData`], and the
//! deterministic reductions and concatenations.
//!
//! Reductions run on the host, not on the device, so that the summation order is fixed by
//! this code (group-rank order, element by element) whatever the backend does with its
//! kernels. Values are held as `f64` for `f64` tensors and as `f32` otherwise; `f16`/`bf16`
//! round-trip through `f32` exactly, so gathers and broadcasts stay bitwise exact.

use std::ops::{Add, Div, Range};

use burn::tensor::{DType, TensorData};

use super::ReduceOp;

/// A tensor's values on the host, in one of the two accumulation precisions.
#[derive(Debug, Clone)]
pub(crate) enum HostValues {
    /// Values of `f32`, `f16`, `bf16` and `flex32` tensors.
    F32(Vec<f32>),
    /// Values of `f64` tensors.
    F64(Vec<f64>),
}

/// One rank's contribution to a collective, shared read-only by all receivers.
#[derive(Debug, Clone)]
pub(crate) struct HostBuf {
    /// The contribution's shape.
    pub(crate) shape: Vec<usize>,
    /// The dtype the tensor had on the device, restored when rebuilding it.
    pub(crate) dtype: DType,
    /// The values, row-major.
    pub(crate) values: HostValues,
}

impl HostBuf {
    /// Takes the values out of device-read data; fails for non-float data.
    pub(crate) fn from_data(data: TensorData) -> Result<Self, String> {
        let dtype = data.dtype;
        if !dtype.is_float() {
            return Err(format!("expected float data, got {dtype:?}"));
        }
        let shape = data.shape.as_slice().to_vec();
        let values = match dtype {
            DType::F64 => HostValues::F64(data.into_vec::<f64>().map_err(|e| e.to_string())?),
            _ => HostValues::F32(
                data.convert::<f32>()
                    .into_vec::<f32>()
                    .map_err(|e| e.to_string())?,
            ),
        };
        Ok(HostBuf {
            shape,
            dtype,
            values,
        })
    }

    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        match &self.values {
            HostValues::F32(v) => v.len(),
            HostValues::F64(v) => v.len(),
        }
    }

    /// Elements `range` (row-major) as 1-D tensor data with the original dtype: what travels
    /// when only a part of a contribution is sent. Half values narrow back exactly.
    pub(crate) fn slice_data(&self, range: Range<usize>) -> TensorData {
        let len = range.len();
        let data = match &self.values {
            HostValues::F32(v) => TensorData::new(v[range].to_vec(), [len]),
            HostValues::F64(v) => TensorData::new(v[range].to_vec(), [len]),
        };
        data.convert_dtype(self.dtype)
    }

    /// Tensor data with the original dtype, ready to be put on a device.
    pub(crate) fn into_data(self) -> TensorData {
        let data = match self.values {
            HostValues::F32(v) => TensorData::new(v, self.shape),
            HostValues::F64(v) => TensorData::new(v, self.shape),
        };
        data.convert_dtype(self.dtype)
    }
}

/// Float types the host reductions run in.
trait HostFloat: Copy + Add<Output = Self> + Div<Output = Self> {
    /// `n` as this type (group sizes are small, so the conversion is exact).
    fn from_count(n: usize) -> Self;
}

impl HostFloat for f32 {
    fn from_count(n: usize) -> Self {
        n as f32
    }
}

impl HostFloat for f64 {
    fn from_count(n: usize) -> Self {
        n as f64
    }
}

/// `((p0 + p1) + p2) + …` over `range`, element by element, then `/ n` for a mean.
///
/// The fixed left-to-right order is what makes results identical on every rank and run.
fn reduce_slices<E: HostFloat>(parts: &[&[E]], range: Range<usize>, op: ReduceOp) -> Vec<E> {
    let Some((first, rest)) = parts.split_first() else {
        return Vec::new();
    };
    let mut acc = first[range.clone()].to_vec();
    for part in rest {
        for (a, &x) in acc.iter_mut().zip(&part[range.clone()]) {
            *a = *a + x;
        }
    }
    if op == ReduceOp::Mean {
        let n = E::from_count(parts.len());
        for a in &mut acc {
            *a = *a / n;
        }
    }
    acc
}

/// A part of a collective: elements `range` of one member's contribution `buf`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part<'a> {
    pub(crate) buf: &'a HostBuf,
    pub(crate) range: &'a Range<usize>,
}

impl Part<'_> {
    fn len(&self) -> usize {
        self.range.len()
    }
}

/// Checks that all parts share the first part's dtype and precision; the error names the
/// offending index.
fn check_dtypes(parts: &[Part<'_>]) -> Result<DType, (usize, String)> {
    let first = parts.first().map(|p| p.buf);
    let dtype = first.map(|p| p.dtype).unwrap_or(DType::F32);
    let wide = matches!(first.map(|p| &p.values), Some(HostValues::F64(_)));
    for (i, p) in parts.iter().enumerate() {
        if p.buf.dtype != dtype || matches!(p.buf.values, HostValues::F64(_)) != wide {
            return Err((
                i,
                format!(
                    "dtype {:?} differs from group rank 0's {dtype:?}",
                    p.buf.dtype
                ),
            ));
        }
        if p.range.end > p.buf.len() {
            return Err((
                i,
                format!(
                    "elements {:?} are beyond a contribution of {}",
                    p.range,
                    p.buf.len()
                ),
            ));
        }
    }
    Ok(dtype)
}

/// The f32 slices of `parts`; [`check_dtypes`] has checked they all are f32.
fn f32_slices<'a>(parts: &[Part<'a>]) -> Vec<&'a [f32]> {
    parts
        .iter()
        .map(|p| match &p.buf.values {
            HostValues::F32(v) => &v[p.range.clone()],
            HostValues::F64(_) => &[],
        })
        .collect()
}

/// The f64 slices of `parts`; [`check_dtypes`] has checked they all are f64.
fn f64_slices<'a>(parts: &[Part<'a>]) -> Vec<&'a [f64]> {
    parts
        .iter()
        .map(|p| match &p.buf.values {
            HostValues::F64(v) => &v[p.range.clone()],
            HostValues::F32(_) => &[],
        })
        .collect()
}

/// Reduces equal-length parts (all of one dtype, in group-rank order) element by element
/// into a buffer of shape `shape`. On error, returns the index of the offending part.
pub(crate) fn reduce(
    parts: &[Part<'_>],
    op: ReduceOp,
    shape: Vec<usize>,
) -> Result<HostBuf, (usize, String)> {
    let dtype = check_dtypes(parts)?;
    let len = parts.first().map_or(0, Part::len);
    if let Some(i) = parts.iter().position(|p| p.len() != len) {
        return Err((
            i,
            format!("{} elements where group rank 0 has {len}", parts[i].len()),
        ));
    }
    let values = match parts.first().map(|p| &p.buf.values) {
        Some(HostValues::F64(_)) => HostValues::F64(reduce_slices(&f64_slices(parts), 0..len, op)),
        _ => HostValues::F32(reduce_slices(&f32_slices(parts), 0..len, op)),
    };
    Ok(HostBuf {
        shape,
        dtype,
        values,
    })
}

/// Concatenates parts (equal dtype) in order into a buffer of shape `shape`. On error,
/// returns the offending index.
pub(crate) fn concat(parts: &[Part<'_>], shape: Vec<usize>) -> Result<HostBuf, (usize, String)> {
    let dtype = check_dtypes(parts)?;
    let values = match parts.first().map(|p| &p.buf.values) {
        Some(HostValues::F64(_)) => HostValues::F64(f64_slices(parts).concat()),
        _ => HostValues::F32(f32_slices(parts).concat()),
    };
    Ok(HostBuf {
        shape,
        dtype,
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(v: Vec<f32>) -> HostBuf {
        HostBuf {
            shape: vec![v.len()],
            dtype: DType::F32,
            values: HostValues::F32(v),
        }
    }

    #[test]
    fn reduce_sums_in_group_rank_order_then_divides() {
        let (a, b, c) = (
            buf(vec![1.0, 1e8]),
            buf(vec![2.0, 1.0]),
            buf(vec![3.0, -1e8]),
        );
        let (all, second) = (0..2, 1..2);
        let parts = |range| [&a, &b, &c].map(|buf| Part { buf, range });
        let sum = reduce(&parts(&all), ReduceOp::Sum, vec![2]).unwrap();
        // (1e8 + 1) rounds back to 1e8 in f32, so the order is visible in the result.
        let expected = [(1.0f32 + 2.0) + 3.0, (1e8f32 + 1.0) + -1e8];
        match sum.values {
            HostValues::F32(v) => assert_eq!(v, expected),
            HostValues::F64(_) => panic!("wrong precision"),
        }
        let mean = reduce(&parts(&second), ReduceOp::Mean, vec![1]).unwrap();
        match mean.values {
            HostValues::F32(v) => assert_eq!(v, vec![expected[1] / 3.0]),
            HostValues::F64(_) => panic!("wrong precision"),
        }
    }

    #[test]
    fn data_round_trip_keeps_dtype_and_values() {
        let data = TensorData::new(vec![1.5f64, -2.25], [2]);
        let host = HostBuf::from_data(data.clone()).unwrap();
        assert_eq!(host.into_data(), data);
        let ints = TensorData::new(vec![1i32, 2], [2]);
        assert!(HostBuf::from_data(ints).is_err());
    }
}
