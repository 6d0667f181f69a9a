//! Autodiff driven from several threads at once: gradients must not go missing, and the
//! graphs of tensors that never take part in a backward must still be freed.
//!
//! Burn 0.21.0's autodiff ends every `backward()` with a sweep over the graphs of *all*
//! threads that frees steps it believes unused (tracel-ai/burn#5573). An operation under
//! construction could drop its inputs' tensors before registering its own step, and if a
//! sweep ran in that window it freed the inputs' steps: the gradients of everything upstream
//! silently went missing. `vendor/burn-autodiff` pins the inputs until the step is registered
//! (see `vendor/README.md`). The sweep itself must stay: it is what frees the graphs of
//! tensors marked `require_grad` that never take part in a backward (tracel-ai/burn#4039),
//! which scoping it to the graph of the current backward (the rejected tracel-ai/burn#5596)
//! would leak.
//!
//! - [`concurrent_backward_keeps_every_gradient`] races graph construction against
//!   backwards on other threads and checks every gradient against a single-threaded
//!   reference.
//! - [`unused_roots_are_freed_while_other_threads_run_backward`] counts live heap bytes
//!   (this binary's global allocator) while one thread abandons `require_grad` graphs and
//!   another runs backwards.
//!
//! How they were shown to fail: this file, built in a scratch crate against `burn` 0.21.0 with
//! the workspace's profiles (test code at opt-level 1, dependencies at 2), each test run 30
//! times per variant of `burn-autodiff` on a 2-core machine under load:
//!
//! - as published (no patch): the gradient test failed 30 of 30 runs, each in 0.3-1.4 s; per
//!   run `cat` lost 4-171 of its 320 gradients, the custom op 86-132, the layer norm none.
//!   The memory test passed 30 of 30 (live heap growth under 4 KiB).
//! - `vendor/burn-autodiff`: both passed 30 of 30 (gradient test 0.3-0.4 s, heap growth
//!   under 4 KiB).
//! - only the `float_cat` half of the patch: the gradient test failed 30 of 30 (the custom op
//!   lost 85-116 gradients per run).
//! - the sweep limited to the graph of the current backward, as tracel-ai/burn#5596 proposed:
//!   the gradient test passed 30 of 30, the memory test failed 30 of 30 (the heap grew by
//!   44.8 MB: all 300 abandoned graphs were kept).
//!
//! The layer norm (Burn's own ops) never lost a gradient: those ops keep their input tensors
//! until their step is registered. It stays as a check of ordinary ops.
//!
//! The two tests take a lock so they never run at the same time: the memory test counts
//! every allocation of the process.

// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::ops::{FloatTensor, ModuleOps};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

type B = Autodiff<Flex>;

/// The global allocator of this test binary: the system allocator, counting live bytes.
struct CountingAlloc;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded unchanged to `System`; the counter is only bookkeeping.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE_BYTES.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        new
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// Counts a thread as finished when dropped, also when the thread panics, so that the
/// threads waiting for it stop and the test fails instead of hanging.
struct Finished<'a>(&'a AtomicUsize);

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

/// One backward of a tiny graph of its own: all it does to other threads is the sweep over
/// every graph of the process that ends each backward.
fn sweep() {
    let x = Tensor::<B, 1>::from_floats([1.0, 2.0], &Default::default());
    x.require_grad().sum().backward();
}

/// Serialises the tests of this file (see the module docs).
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Side of the square leaves; large enough that `cat` copies for a while.
const SIZE: usize = 192;
/// Threads that build graphs (each runs `ROUNDS` rounds of [`losses`]) and threads that only
/// run backwards: more threads than cores, so builders are often preempted inside an op.
const VICTIMS: usize = 4;
const SWEEPERS: usize = 4;
const ROUNDS: usize = 40;

/// Deterministic values in [-1, 1), distinct per `seed`.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            // xorshift64: reproducible without a random-number crate.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A `SIZE` x `SIZE` autodiff tensor (not requiring gradients) filled by [`values`].
fn matrix(seed: u64) -> Tensor<B, 2> {
    let data = TensorData::new(values(seed, SIZE * SIZE), [SIZE, SIZE]);
    Tensor::from_data(data, &Default::default())
}

/// `2 x` as a custom autodiff op that lets go of its input tensor before computing, as an
/// op that moves its inputs into a helper would: only its `OpsPrep` still names the input.
#[derive(Debug)]
struct Twice;

impl Backward<Flex, 1> for Twice {
    type State = ();

    fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<Flex>(&ops.node);
        if let Some(parent) = parent {
            let grad = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(grad));
            grads.register::<Flex>(parent.id, grad.mul_scalar(2.0).into_primitive().tensor());
        }
    }
}

/// `2 x` through [`Twice`].
fn twice(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let x: FloatTensor<B> = x.into_primitive().tensor();
    let prep = Twice
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful();
    let input = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(x.into_primitive()));
    // Stands for a slow kernel: other threads run (and sweep) between the input's tensor
    // being dropped and the step being registered.
    thread::yield_now();
    let output = input.mul_scalar(2.0).into_primitive().tensor();
    let output = match prep {
        OpsKind::Tracked(prep) => prep.finish((), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The graphs of one round, built from the leaves `a` and `c`, each ending in a scalar loss.
/// Every input of the ops that race is a temporary, so while the op runs nothing but the op
/// itself refers to it.
fn losses(
    a: &Tensor<B, 2>,
    c: &Tensor<B, 2>,
    weights: &Tensor<B, 2>,
) -> [(&'static str, Tensor<B, 1>); 3] {
    // `cat` of temporaries: the trigger named in tracel-ai/burn#5573.
    let cat = Tensor::cat(vec![a.clone().mul_scalar(2.0), c.clone().exp()], 0);
    let cat = (cat.clone() * cat).sum();

    // burn-nn's `LayerNorm`: the backend's `layer_norm`, a chain of ordinary ops.
    let gamma = c.clone().sum_dim(0).reshape([SIZE]);
    let normed = B::layer_norm(
        a.clone().mul_scalar(2.0).into_primitive().tensor(),
        gamma.into_primitive().tensor(),
        None,
        1e-5,
    );
    let norm =
        (Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(normed)) * weights.clone()).sum();

    // A custom op that drops its input before registering its step.
    let custom = (twice(a.clone().mul_scalar(3.0)) * c.clone()).sum();

    [("cat", cat), ("layer norm", norm), ("custom op", custom)]
}

/// The gradients of `a` and `c` for each loss of [`losses`]; `None` where one is missing.
type Grads = Vec<(&'static str, [Option<Tensor<Flex, 2>>; 2])>;

/// Builds the graphs of [`losses`] and runs their backwards, one after the other.
fn round(a: &Tensor<B, 2>, c: &Tensor<B, 2>, weights: &Tensor<B, 2>) -> Grads {
    losses(a, c, weights)
        .into_iter()
        .map(|(name, loss)| {
            let grads = loss.backward();
            (name, [a.grad(&grads), c.grad(&grads)])
        })
        .collect()
}

/// What the victim threads saw, per loss of [`losses`]: gradients checked, missing, wrong.
#[derive(Default)]
struct Tally {
    counts: Mutex<BTreeMap<&'static str, [usize; 3]>>,
    first: Mutex<Option<String>>,
}

impl Tally {
    fn check(&self, round: usize, got: &Grads, expected: &Grads) {
        for ((name, got), (_, expected)) in got.iter().zip(expected) {
            for (leaf, (got, expected)) in ["a", "c"].iter().zip(got.iter().zip(expected)) {
                let expected = expected.as_ref().expect("the reference has every gradient");
                let problem = match got {
                    None => Some("missing".to_string()),
                    Some(got) => {
                        let diff: f32 = (got.clone() - expected.clone()).abs().max().into_scalar();
                        let scale: f32 = expected.clone().abs().max().into_scalar();
                        (diff > 1e-4 * scale.max(1.0)).then(|| format!("off by up to {diff}"))
                    }
                };
                let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
                let count = counts.entry(name).or_default();
                count[0] += 1;
                let Some(problem) = problem else { continue };
                count[if got.is_none() { 1 } else { 2 }] += 1;
                let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert_with(|| {
                    format!("round {round}, {name}: gradient of `{leaf}` {problem}")
                });
            }
        }
    }

    /// One line per loss, e.g. `cat: 3 missing, 0 wrong of 320`.
    fn summary(&self) -> String {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let lines: Vec<String> = counts
            .iter()
            .map(|(name, [checked, missing, wrong])| {
                format!("{name}: {missing} missing, {wrong} wrong of {checked}")
            })
            .collect();
        lines.join("; ")
    }
}

/// Threads that build graphs (victims) race threads that only run backwards (sweepers):
/// every gradient must equal the one computed on a single thread.
#[test]
fn concurrent_backward_keeps_every_gradient() {
    let _serial = serial();
    let weights = matrix(1);
    let leaves: Vec<_> = (0..VICTIMS as u64)
        .map(|v| (matrix(10 + v).require_grad(), matrix(20 + v).require_grad()))
        .collect();
    // One backward through each leaf first: it drops the leaves' entries from the graph
    // registry, as for parameters reused after a backward, so each op on a leaf starts a
    // graph of its own that no tensor of the victim refers to while the next op is built.
    let references: Vec<Grads> = leaves
        .iter()
        .map(|(a, c)| {
            (a.clone() + c.clone()).sum().backward();
            round(a, c, &weights)
        })
        .collect();

    let tally = Tally::default();
    let victims_done = AtomicUsize::new(0);
    thread::scope(|s| {
        for ((a, c), expected) in leaves.iter().zip(&references) {
            let (tally, victims_done, weights) = (&tally, &victims_done, &weights);
            s.spawn(move || {
                let _finished = Finished(victims_done);
                for r in 0..ROUNDS {
                    tally.check(r, &round(a, c, weights), expected);
                }
            });
        }
        for _ in 0..SWEEPERS {
            let victims_done = &victims_done;
            s.spawn(move || {
                while victims_done.load(Ordering::Acquire) < VICTIMS {
                    sweep();
                }
            });
        }
    });

    let summary = tally.summary();
    eprintln!("gradients: {summary}");
    let first = tally.first.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(first) = first {
        panic!("gradients differ from a single-threaded run ({summary}); first: {first}");
    }
}

/// One thread keeps making `require_grad` tensors and small graphs from them that never see
/// a backward; other threads' backwards must free them.
fn abandon_graphs(iterations: usize) {
    let done = AtomicUsize::new(0);
    thread::scope(|s| {
        s.spawn(|| {
            let _finished = Finished(&done);
            for i in 0..iterations {
                let t = matrix(i as u64).require_grad();
                // A step whose state holds a buffer of the size of `t`.
                let _abandoned = t.clone() * t;
            }
        });
        s.spawn(|| {
            while done.load(Ordering::Acquire) == 0 {
                sweep();
            }
        });
    });
    // A sweep frees one layer of an abandoned graph (its roots), so run a few more.
    for _ in 0..4 {
        sweep();
    }
}

/// Live heap bytes must not grow with the number of abandoned graphs: the backwards of other
/// threads free them.
#[test]
fn unused_roots_are_freed_while_other_threads_run_backward() {
    let _serial = serial();
    const ITERATIONS: usize = 300;
    // First-use allocations (thread pools, registry capacity) are not what is measured.
    abandon_graphs(ITERATIONS / 4);
    let before = LIVE_BYTES.load(Ordering::Relaxed);
    abandon_graphs(ITERATIONS);
    let grown = LIVE_BYTES.load(Ordering::Relaxed) - before;

    // Each abandoned graph holds at least one buffer of SIZE x SIZE floats while it lives.
    let per_graph = (SIZE * SIZE * std::mem::size_of::<f32>()) as isize;
    let leaked_graphs = grown as f64 / per_graph as f64;
    eprintln!("live heap grew by {grown} bytes ({leaked_graphs:.1} abandoned graphs' worth)");
    assert!(
        grown < 16 * per_graph,
        "live heap grew by {grown} bytes over {ITERATIONS} abandoned graphs: {leaked_graphs:.1} \
         graphs' worth were not freed"
    );
}
