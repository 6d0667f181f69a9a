//! From a [`SimConfig`] and a stage placement to the duration of every action and the bytes
//! every stage holds: the only place where the model meets the hardware.

use crate::schedule::{split_layers, LayerSplit, ZeroLevel};

use super::cost_table::CostTable;
use super::volume::{gather_bytes, gradient_reduction, reduce_bytes, CollectiveKind};
use super::{ModelConfig, SimConfig, SimError};

/// Where every GPU sits: world rank = (dp_index·P + pp_index)·T + tp_index (tensor-parallel
/// ranks innermost, then the pipeline, then the replicas), node = world rank ÷ GPUs per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Pipeline ranks P.
    pub pp: usize,
    /// Data-parallel replicas D.
    pub dp: usize,
    /// Tensor-parallel size T.
    pub tp: usize,
    /// GPUs per node.
    pub gpus_per_node: usize,
}

impl Topology {
    /// World rank of a GPU.
    pub fn world_rank(&self, dp_index: usize, pp_index: usize, tp_index: usize) -> usize {
        (dp_index * self.pp + pp_index) * self.tp + tp_index
    }

    fn node(&self, world: usize) -> usize {
        world / self.gpus_per_node
    }

    /// True when pipeline ranks `a` and `b` share a node in every replica and for every
    /// tensor-parallel index; a hop is costed on its slowest instance, because the replicas'
    /// collectives keep them in lockstep.
    pub fn p2p_same_node(&self, a: usize, b: usize) -> bool {
        (0..self.dp).all(|d| {
            (0..self.tp)
                .all(|t| self.node(self.world_rank(d, a, t)) == self.node(self.world_rank(d, b, t)))
        })
    }

    /// True when the data-parallel group of pipeline rank `pp_index` lies in one node.
    pub fn dp_group_same_node(&self, pp_index: usize) -> bool {
        (0..self.tp).all(|t| {
            let first = self.node(self.world_rank(0, pp_index, t));
            (0..self.dp).all(|d| self.node(self.world_rank(d, pp_index, t)) == first)
        })
    }

    /// True when every tensor-parallel group of pipeline rank `pp_index` lies in one node.
    pub fn tp_group_same_node(&self, pp_index: usize) -> bool {
        (0..self.dp).all(|d| {
            let first = self.node(self.world_rank(d, pp_index, 0));
            (0..self.tp).all(|t| self.node(self.world_rank(d, pp_index, t)) == first)
        })
    }
}

impl CostTable {
    /// Cost every stage of a schedule with `stage_ranks` placement and `microbatches`.
    pub fn new(
        cfg: &SimConfig,
        stage_ranks: &[usize],
        num_ranks: usize,
        microbatches: usize,
    ) -> Result<Self, SimError> {
        cfg.check()?;
        let stages = stage_ranks.len();
        let topo = Topology {
            pp: num_ranks,
            dp: cfg.dp,
            tp: cfg.tp,
            gpus_per_node: cfg.hardware.gpus_per_node,
        };
        match &cfg.model {
            ModelConfig::Unit(u) => {
                let b = u.forward_time * u.backward_ratio;
                Ok(CostTable {
                    unit_time: true,
                    forward: vec![u.forward_time; stages],
                    backward: vec![b; stages],
                    backward_input: vec![b / 2.0; stages],
                    backward_weight: vec![b / 2.0; stages],
                    message_bytes: vec![0; stages],
                    weight_elem_bytes: cfg.dtype.bytes(),
                    grad_elem_bytes: cfg.grad_reduce_dtype.unwrap_or(cfg.dtype).bytes(),
                    transfer: vec![0.0; stages],
                    gather: vec![0.0; stages],
                    reduce: vec![0.0; stages],
                    parameters: vec![u.stage_parameters; stages],
                    activation_bytes: vec![u.stage_activation_bytes; stages],
                    weight_grad_bytes: vec![u.stage_activation_bytes; stages],
                    optimizer: vec![0.0; num_ranks],
                    start: vec![0.0; num_ranks],
                    step_model_flops: 0.0,
                    tokens_per_step: (microbatches * cfg.micro_batch_size) as f64,
                })
            }
            ModelConfig::Gpt(g) => {
                let hw = &cfg.hardware;
                let (b, t) = (cfg.micro_batch_size, cfg.tp);
                let elem = cfg.dtype.bytes();
                let ranges = split_layers(g.layers, stages, &LayerSplit::Even)?;
                let mut table = CostTable {
                    unit_time: false,
                    forward: Vec::with_capacity(stages),
                    backward: Vec::with_capacity(stages),
                    backward_input: Vec::with_capacity(stages),
                    backward_weight: Vec::with_capacity(stages),
                    message_bytes: Vec::with_capacity(stages),
                    weight_elem_bytes: elem,
                    grad_elem_bytes: cfg.grad_reduce_dtype.unwrap_or(cfg.dtype).bytes(),
                    transfer: Vec::with_capacity(stages),
                    gather: Vec::with_capacity(stages),
                    reduce: Vec::with_capacity(stages),
                    parameters: Vec::with_capacity(stages),
                    activation_bytes: Vec::with_capacity(stages),
                    weight_grad_bytes: Vec::with_capacity(stages),
                    optimizer: vec![0.0; num_ranks],
                    start: vec![0.0; num_ranks],
                    step_model_flops: g.step_model_flops(microbatches * b),
                    tokens_per_step: (microbatches * b * g.sequence) as f64,
                };
                // Megatron-LM's tensor parallelism all-reduces the b·s·h block output twice in
                // the forward (attention, MLP) and twice in the backward (Shoeybi et al. 2019,
                // "Megatron-LM", Fig. 4).
                let activation_msg = g.boundary_elements(b) as f64 * elem as f64;
                let layer_gemm: f64 = g
                    .layer_gemms(b, t)
                    .iter()
                    .map(|&m| hw.gemm_time(m, elem))
                    .sum();
                let head_gemm = hw.gemm_time((b * g.sequence, g.vocabulary / t, g.hidden, 1), elem);
                for (s, range) in ranges.iter().enumerate() {
                    let rank = stage_ranks[s];
                    let tp_ar =
                        hw.ring_all_reduce_time(activation_msg, t, topo.tp_group_same_node(rank));
                    let layers = range.len() as f64;
                    let last = s + 1 == stages;
                    let mut fwd = layers * (layer_gemm + 2.0 * tp_ar);
                    // Each forward GEMM has two backward GEMMs of the same shape (input and
                    // weight gradients), so the backward is twice the forward's GEMM time.
                    let mut bwd_input = layers * (layer_gemm + 2.0 * tp_ar);
                    let mut bwd_weight = layers * layer_gemm;
                    if last {
                        fwd += head_gemm;
                        bwd_input += head_gemm;
                        bwd_weight += head_gemm;
                    }
                    if cfg.recompute {
                        // Full recomputation re-runs the forward before the backward.
                        bwd_input += fwd;
                    }
                    table.forward.push(fwd);
                    table.backward.push(bwd_input + bwd_weight);
                    table.backward_input.push(bwd_input);
                    table.backward_weight.push(bwd_weight);

                    // Megatron-LM's scatter/gather optimisation sends 1/T of the message from
                    // each tensor-parallel rank (Narayanan et al. 2021, §4.1).
                    let msg = g.boundary_elements(b) * elem / t as u64;
                    let next_rank = stage_ranks.get(s + 1).copied().unwrap_or(rank);
                    table.message_bytes.push(msg);
                    table
                        .transfer
                        .push(hw.p2p_time(msg as f64, topo.p2p_same_node(rank, next_rank)));

                    let mut params = range.len() as u64 * g.layer_parameters();
                    if s == 0 {
                        params += g.embedding_parameters();
                    }
                    if last && stages > 1 {
                        params += g.head_parameters();
                    }
                    // Tensor parallelism splits every matrix (and, approximately, the rest).
                    let params = params.div_ceil(t as u64);
                    table.parameters.push(params);
                    // The bytes each member sends (`volume`), over the ring's d − 1 steps
                    // (twice for an all-reduce), each paying the link's latency.
                    let dp_local = topo.dp_group_same_node(rank);
                    let steps = cfg.dp.saturating_sub(1);
                    let gathered = gather_bytes(&table, s, cfg.dp);
                    table
                        .gather
                        .push(hw.collective_time(gathered, steps, dp_local));
                    let reduced = reduce_bytes(&table, s, cfg.dp, cfg.zero);
                    let rounds = match gradient_reduction(cfg.zero) {
                        CollectiveKind::AllReduce => 2,
                        _ => 1,
                    };
                    table
                        .reduce
                        .push(hw.collective_time(reduced, rounds * steps, dp_local));

                    let mut act =
                        layers * g.layer_activation_bytes(b, t, cfg.flash_attention, cfg.recompute);
                    if last {
                        act += g.loss_activation_bytes(b, t);
                    }
                    table.activation_bytes.push(act.round() as u64);
                    let mut deferred = layers * g.layer_weight_grad_bytes(b, t, elem);
                    if last {
                        deferred += g.head_weight_grad_bytes(b, t, elem);
                    }
                    table
                        .weight_grad_bytes
                        .push(deferred.min(act).round() as u64);
                }
                // Adam is memory bound: it reads and writes its state, reads the gradient and
                // writes the weights, each once, at HBM bandwidth.
                let per_param =
                    (2 * cfg.dtype.optimizer_bytes() + 2 * elem) as f64 / hw.hbm_bandwidth;
                for (s, &rank) in stage_ranks.iter().enumerate() {
                    let owned = if cfg.zero == ZeroLevel::Zero0 {
                        table.parameters[s]
                    } else {
                        table.parameters[s].div_ceil(cfg.dp as u64)
                    };
                    table.optimizer[rank] += owned as f64 * per_param;
                }
                Ok(table)
            }
        }
    }
}
