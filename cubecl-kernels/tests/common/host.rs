//! Independent float64 references computed on the host in plain Rust (no Burn), the oracle
//! for every backend's fused ops.

/// Attention problem in row-major `[batch, heads, seq, head_dim]` layout.
pub struct AttnCase {
    pub b: usize,
    pub h: usize,
    pub sq: usize,
    pub sk: usize,
    pub d: usize,
    pub causal: bool,
    /// `[b, sk]`, `true` = padded key.
    pub mask: Option<Vec<bool>>,
    /// Key row `j` is scaled by `1 + key_ramp · j / sk` (0: plain random keys), so that
    /// later keys score far higher and a row's running max keeps growing along the sequence.
    pub key_ramp: f32,
}

/// `(out, lse, dq, dk, dv)` of attention in float64, for output gradient `dout`.
pub struct AttnRef {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Same sentinel as `cubecl_kernels::reference::EMPTY_ROW_LSE`, restated so the oracle does
/// not depend on the crate under test.
pub const EMPTY_ROW_LSE: f64 = -1.0e30;

pub fn attention(c: &AttnCase, q: &[f32], k: &[f32], v: &[f32], dout: &[f32]) -> AttnRef {
    let (d, sq, sk) = (c.d, c.sq, c.sk);
    let scale = 1.0 / (d as f64).sqrt();
    let n_q = c.b * c.h * sq * d;
    let n_k = c.b * c.h * sk * d;
    let mut r = AttnRef {
        out: vec![0.0; n_q],
        lse: vec![EMPTY_ROW_LSE; c.b * c.h * sq],
        dq: vec![0.0; n_q],
        dk: vec![0.0; n_k],
        dv: vec![0.0; n_k],
    };
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
    };
    for bh in 0..c.b * c.h {
        let batch = bh / c.h;
        for i in 0..sq {
            let qi = &q[(bh * sq + i) * d..][..d];
            let doi = &dout[(bh * sq + i) * d..][..d];
            let visible: Vec<usize> = (0..sk)
                .filter(|&j| !(c.causal && j > i))
                .filter(|&j| c.mask.as_ref().is_none_or(|m| !m[batch * sk + j]))
                .collect();
            if visible.is_empty() {
                continue;
            }
            let s: Vec<f64> = visible
                .iter()
                .map(|&j| scale * dot(qi, &k[(bh * sk + j) * d..][..d]))
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
            r.lse[bh * sq + i] = m + l.ln();
            let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / l).collect();
            let o = &mut r.out[(bh * sq + i) * d..][..d];
            for (pj, &j) in p.iter().zip(&visible) {
                for (oc, vc) in o.iter_mut().zip(&v[(bh * sk + j) * d..][..d]) {
                    *oc += pj * *vc as f64;
                }
            }
            let delta: f64 = o.iter().zip(doi).map(|(a, b)| a * *b as f64).sum();
            for (pj, &j) in p.iter().zip(&visible) {
                let vj = &v[(bh * sk + j) * d..][..d];
                let kj = &k[(bh * sk + j) * d..][..d];
                let ds = pj * (dot(doi, vj) - delta);
                for x in 0..d {
                    r.dv[(bh * sk + j) * d + x] += pj * doi[x] as f64;
                    r.dq[(bh * sq + i) * d + x] += ds * kj[x] as f64 * scale;
                    r.dk[(bh * sk + j) * d + x] += ds * qi[x] as f64 * scale;
                }
            }
        }
    }
    r
}

/// erf to ~1e-12 for all x: Maclaurin series where it converges fast, ±1 beyond |x| = 5
/// (erfc(5) ≈ 1.5e-12).
pub fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// `(y, dx, dw, db)` of `gelu(x·w + b)` for output gradient `dy`; `x` `[n, din]`, `w`
/// `[din, dout]`.
#[allow(clippy::type_complexity)]
pub fn linear_gelu(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    dy: &[f32],
    n: usize,
    din: usize,
    dout: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut y, mut dx) = (vec![0.0; n * dout], vec![0.0; n * din]);
    let (mut dw, mut db) = (vec![0.0; din * dout], vec![0.0; dout]);
    for r in 0..n {
        for o in 0..dout {
            let z = b[o] as f64
                + (0..din)
                    .map(|i| x[r * din + i] as f64 * w[i * dout + o] as f64)
                    .sum::<f64>();
            let cdf = 0.5 * (1.0 + erf(z / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
            y[r * dout + o] = z * cdf;
            let dz = dy[r * dout + o] as f64 * (cdf + z * pdf);
            db[o] += dz;
            for i in 0..din {
                dx[r * din + i] += dz * w[i * dout + o] as f64;
                dw[i * dout + o] += dz * x[r * din + i] as f64;
            }
        }
    }
    (y, dx, dw, db)
}

/// `(loss, dh, dw)` of the mean cross-entropy of `softmax(h·w)` (loss gradient 1).
pub fn linear_cross_entropy(
    h: &[f32],
    w: &[f32],
    targets: &[i64],
    ignore: i64,
    hidden: usize,
    vocab: usize,
) -> (f64, Vec<f64>, Vec<f64>) {
    let n = targets.len();
    let count = targets.iter().filter(|&&t| t != ignore).count().max(1) as f64;
    let (mut loss, mut dh, mut dw) = (0.0, vec![0.0; n * hidden], vec![0.0; hidden * vocab]);
    for r in 0..n {
        if targets[r] == ignore {
            continue;
        }
        let logits: Vec<f64> = (0..vocab)
            .map(|o| {
                (0..hidden)
                    .map(|i| h[r * hidden + i] as f64 * w[i * vocab + o] as f64)
                    .sum()
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l: f64 = logits.iter().map(|x| (x - m).exp()).sum();
        let t = targets[r] as usize;
        loss += (m + l.ln() - logits[t]) / count;
        for o in 0..vocab {
            let g = ((logits[o] - m).exp() / l - if o == t { 1.0 } else { 0.0 }) / count;
            for i in 0..hidden {
                dh[r * hidden + i] += g * w[i * vocab + o] as f64;
                dw[i * vocab + o] += g * h[r * hidden + i] as f64;
            }
        }
    }
    (loss, dh, dw)
}
