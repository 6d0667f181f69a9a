//! The flags of `bfpp train`, and how they override the configuration file.
//!
//! Every flag is optional: a flag that is not given leaves the value from `--config` (or the
//! embedded default) alone, which is why they are `Option`s rather than clap defaults.

use std::path::PathBuf;
use std::str::FromStr;

use burn_bfpp::engine::LrConfig;
use burn_bfpp::schedule::ZeroLevel;
use clap::Args;

use super::config::BfppConfig;
use super::error::TrainError;

/// `bfpp train [FLAGS]`.
#[derive(Debug, Clone, Default, Args)]
pub struct TrainArgs {
    /// A TOML configuration file (sections [train], [model], [data], [run]); flags override
    /// its values. `--print-config` shows the format.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit without training.
    #[arg(long)]
    pub print_config: bool,
    /// The Burn backend that trains: flex (CPU), wgpu or cuda (those two need a build with
    /// `--features wgpu` / `--features cuda`).
    #[arg(long, value_enum, default_value_t)]
    pub backend: super::backend::BackendChoice,

    /// Pipeline ranks P.
    #[arg(long, help_heading = "Layout")]
    pub pp: Option<usize>,
    /// Stages per pipeline rank V (the model is cut into pp × loops stages).
    #[arg(long, help_heading = "Layout")]
    pub loops: Option<usize>,
    /// Data-parallel replicas D.
    #[arg(long, help_heading = "Layout")]
    pub dp: Option<usize>,
    /// Micro-batches per step and replica M.
    #[arg(long, help_heading = "Layout")]
    pub microbatches: Option<usize>,
    /// Breadth-first micro-batches per sweep K (must divide M).
    #[arg(long, help_heading = "Layout")]
    pub bf_microbatches: Option<usize>,
    /// Samples per micro-batch.
    #[arg(long, help_heading = "Layout", conflicts_with = "global_batch")]
    pub micro_batch_size: Option<usize>,
    /// Samples per step; must be divisible by dp × microbatches (sets the micro-batch size).
    #[arg(long, help_heading = "Layout")]
    pub global_batch: Option<usize>,
    /// Schedule: gpipe, 1f1b, interleaved, breadth-first, or with split backwards (the
    /// model must defer its weight gradients) zb-h1, interleaved-zb, zb-v, breadth-first-zb,
    /// dualpipev.
    #[arg(long, help_heading = "Layout")]
    pub schedule: Option<String>,
    /// Stage placement: looping or v-shape.
    #[arg(long, help_heading = "Layout")]
    pub placement: Option<String>,
    /// Train the compute order of a schedule file (PyTorch's action CSV in either naming, or
    /// `bfpp schedule --format csv`) instead of --schedule: pp, loops and microbatches come
    /// from the file (a flag that disagrees is refused); transfers and collectives are placed
    /// for --zero and --buffers.
    #[arg(
        long,
        value_name = "FILE.csv",
        help_heading = "Layout",
        conflicts_with_all = ["schedule", "placement", "bf_microbatches", "hardware"]
    )]
    pub schedule_file: Option<PathBuf>,
    /// ZeRO level: 0, 1, 2 or 3.
    #[arg(long, help_heading = "Layout")]
    pub zero: Option<u8>,
    /// Rotating full-size weight/gradient buffers per rank.
    #[arg(long, help_heading = "Layout")]
    pub buffers: Option<usize>,
    /// Recompute each stage's forward in its backward (activation checkpointing).
    #[arg(long, help_heading = "Layout")]
    pub recompute: bool,
    /// Layers per stage: even, balanced, or counts such as 3,2,2,3.
    #[arg(long, help_heading = "Layout")]
    pub split: Option<String>,

    /// Transformer blocks (the model has blocks + 2 layers).
    #[arg(long, help_heading = "Model")]
    pub layers: Option<usize>,
    /// Width of the residual stream.
    #[arg(long, help_heading = "Model")]
    pub hidden: Option<usize>,
    /// Attention heads (must divide --hidden).
    #[arg(long, help_heading = "Model")]
    pub heads: Option<usize>,
    /// MLP width as a multiple of --hidden.
    #[arg(long, help_heading = "Model")]
    pub mlp_ratio: Option<usize>,
    /// Fused attention, MLP and loss ops: each where this backend runs it as a kernel not
    /// measured slower than Burn's own path (auto: on CUDA the MLP and the loss, attention
    /// not; none on wgpu and flex), all of them (on; composed ops on the CPU), or none (off).
    #[arg(long, value_name = "auto|on|off", help_heading = "Model")]
    pub fused: Option<burn_bfpp::model::FusedMode>,

    /// Peak learning rate.
    #[arg(long, help_heading = "Optimizer")]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine decay.
    #[arg(long, help_heading = "Optimizer")]
    pub min_lr: Option<f64>,
    /// Steps of linear warm-up.
    #[arg(long, help_heading = "Optimizer")]
    pub warmup_steps: Option<usize>,
    /// AdamW decoupled weight decay.
    #[arg(long, help_heading = "Optimizer")]
    pub weight_decay: Option<f32>,
    /// Global gradient-norm clipping threshold (0: off).
    #[arg(long, help_heading = "Optimizer")]
    pub max_grad_norm: Option<f64>,

    /// A text file or a folder of text files (byte-level tokens); default: the built-in
    /// synthetic Markov corpus, whose entropy rate bounds the loss.
    #[arg(long, value_name = "PATH", help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// Tokens per sample (sets both the model's positions and the data's sample length).
    #[arg(long, help_heading = "Data")]
    pub seq_len: Option<usize>,

    /// Optimizer steps.
    #[arg(long, help_heading = "Run")]
    pub steps: Option<usize>,
    /// Seed of the model initialisation and the sample order.
    #[arg(long, help_heading = "Run")]
    pub seed: Option<u64>,
    /// Seconds a rank waits on a peer before the run fails.
    #[arg(long, value_name = "SECS", help_heading = "Run")]
    pub comm_timeout: Option<f64>,
    /// Let every data-parallel collective wait where it starts instead of overlapping the
    /// compute after it (the baseline for measuring the overlap; results are bitwise equal).
    #[arg(long, help_heading = "Run")]
    pub no_overlap: bool,
    /// A step whose loss or gradient norm is NaN or infinite: stop the run with an error
    /// naming the step (default), or skip its optimizer update with a warning.
    #[arg(long, value_name = "stop|skip", help_heading = "Run")]
    pub on_nonfinite: Option<burn_bfpp::engine::NonFinitePolicy>,
    /// Compute dtype of the stages: fp32 (default), bf16, or f16 (with dynamic loss
    /// scaling). Master weights and AdamW state stay fp32.
    #[arg(long, value_name = "fp32|bf16|f16", help_heading = "Run")]
    pub precision: Option<burn_bfpp::engine::Precision>,
    /// f16 only: initial loss scale (halved on overflow, the step skipped).
    #[arg(long, value_name = "SCALE", help_heading = "Run")]
    pub loss_scale: Option<f64>,
    /// f16 only: finite steps in a row after which the loss scale doubles.
    #[arg(long, value_name = "STEPS", help_heading = "Run")]
    pub loss_scale_growth_interval: Option<usize>,
    /// Where the ranks live and what carries their collectives: from the launch (auto:
    /// MPI processes under mpirun/srun, one process per GPU under `bfpp launch … --backend
    /// cuda`, threads otherwise), threads (local), MPI processes (mpi; a build with
    /// --features mpi), or NCCL collectives (nccl; cuda only).
    #[arg(long, value_enum, default_value_t, help_heading = "Run")]
    pub comm: super::backend::CommMode,
    /// --backend cuda with ranks as threads: spread them over this many GPUs (world rank r on
    /// GPU r % N). For speed, run one process per GPU instead: `bfpp launch --nproc N --
    /// train --backend cuda`, where local rank r computes on GPU r (and --gpus is refused).
    #[arg(long, default_value_t = 1, value_name = "N", help_heading = "Run")]
    pub gpus: usize,
    /// Report MFU against this hardware's peak and the simulator's prediction of the same
    /// layout on it (one GPU per rank) beside the measured step: a preset (a100-80gb,
    /// h100-80gb, h200-141gb) or auto (the GPU nvidia-smi names, under --backend cuda).
    #[arg(long, value_name = "NAME", help_heading = "Run")]
    pub hardware: Option<String>,
    /// Train the same model, data, optimizer and steps with a plain Burn loop on one device
    /// instead of the engine (no pipeline, no sharding, no gradient clipping): the baseline
    /// the engine's throughput is measured against.
    #[arg(long, help_heading = "Run")]
    pub plain_burn: bool,
    /// Folder for metrics.jsonl, trace.json and timeline.svg.
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub out_dir: Option<PathBuf>,
    /// Checkpoint flags (--save, --save-every, --keep, --resume, --init).
    #[command(flatten)]
    pub ckpt: super::checkpoint::CheckpointArgs,
    /// Print one JSON object at the end instead of the progress bar and summary.
    #[arg(long, help_heading = "Output")]
    pub json: bool,
    /// No progress bar and no summary (errors still go to standard error).
    #[arg(long, short, help_heading = "Output")]
    pub quiet: bool,
}

impl TrainArgs {
    /// Overwrites in `cfg` every value given on the command line; a flag that does not fit
    /// the configuration (a learning-rate flag for a scheduler without that setting, a bad
    /// name) is an error naming the fix.
    pub fn apply(&self, cfg: &mut BfppConfig) -> Result<(), TrainError> {
        fn set<T: Clone>(slot: &mut T, value: &Option<T>) {
            if let Some(v) = value {
                *slot = v.clone();
            }
        }
        fn parsed<T: FromStr>(slot: &mut T, value: &Option<String>) -> Result<(), TrainError>
        where
            T::Err: std::fmt::Display,
        {
            if let Some(text) = value {
                *slot = text
                    .parse()
                    .map_err(|e: T::Err| TrainError::Config(e.to_string()))?;
            }
            Ok(())
        }
        let t = &mut cfg.train;
        set(&mut t.steps, &self.steps);
        set(&mut t.pp, &self.pp);
        set(&mut t.loops, &self.loops);
        set(&mut t.dp, &self.dp);
        set(&mut t.microbatches, &self.microbatches);
        if self.bf_microbatches.is_some() {
            t.bf_microbatches = self.bf_microbatches;
        }
        parsed(&mut t.schedule, &self.schedule)?;
        parsed(&mut t.placement, &self.placement)?;
        if let Some(path) = &self.schedule_file {
            let order =
                super::schedule::read_schedule_file(path, self.pp, self.loops, self.microbatches)
                    .map_err(|e| TrainError::Config(e.to_string()))?;
            t.pp = order.num_ranks();
            // Uneven stages are refused by the engine, naming the file.
            t.loops = order.stages_per_rank().unwrap_or(t.loops);
            t.microbatches = order.microbatches;
            t.schedule_file = Some(path.clone());
        }
        if let Some(zero) = self.zero {
            t.zero = ZeroLevel::from_number(zero)?;
        }
        set(&mut t.buffers, &self.buffers);
        t.recompute |= self.recompute;
        parsed(&mut t.split, &self.split)?;
        if let Some(wd) = self.weight_decay {
            t.adamw = t.adamw.clone().with_weight_decay(wd);
        }
        set(&mut t.max_grad_norm, &self.max_grad_norm);
        self.apply_lr(&mut t.lr)?;
        set(&mut t.comm_timeout_secs, &self.comm_timeout);
        if self.no_overlap {
            t.overlap_collectives = false;
        }
        set(&mut t.on_nonfinite, &self.on_nonfinite);
        set(&mut t.precision, &self.precision);
        set(&mut t.loss_scaling.initial_scale, &self.loss_scale);
        set(
            &mut t.loss_scaling.growth_interval,
            &self.loss_scale_growth_interval,
        );

        let m = &mut cfg.model;
        set(&mut m.layers, &self.layers);
        set(&mut m.hidden, &self.hidden);
        set(&mut m.heads, &self.heads);
        set(&mut m.mlp_ratio, &self.mlp_ratio);
        set(&mut m.fused, &self.fused);
        // One flag for both so the two can never disagree.
        set(&mut m.seq_len, &self.seq_len);

        let d = &mut cfg.data;
        set(&mut d.seq_len, &self.seq_len);
        if self.data.is_some() {
            d.path = self.data.clone();
        }
        if self.micro_batch_size.is_some() {
            // A flag beats the file: a global batch from the file would contradict it.
            d.micro_batch_size = self.micro_batch_size;
            d.global_batch = None;
        }
        if self.global_batch.is_some() {
            d.global_batch = self.global_batch;
            d.micro_batch_size = None;
        }
        let r = &mut cfg.run;
        set(&mut r.seed, &self.seed);
        set(&mut r.out_dir, &self.out_dir);
        Ok(())
    }

    /// `--lr`, `--min-lr` and `--warmup-steps` on the configuration's learning rate: they
    /// set the fields of a warm-up + cosine schedule, and `--lr` alone a constant one.
    fn apply_lr(&self, lr: &mut LrConfig) -> Result<(), TrainError> {
        match lr {
            LrConfig::WarmupCosine {
                peak,
                min_lr,
                warmup_steps,
            } => {
                *peak = self.lr.unwrap_or(*peak);
                *min_lr = self.min_lr.unwrap_or(*min_lr);
                *warmup_steps = self.warmup_steps.unwrap_or(*warmup_steps);
                Ok(())
            }
            LrConfig::Constant(value) if self.min_lr.is_none() && self.warmup_steps.is_none() => {
                *value = self.lr.unwrap_or(*value);
                Ok(())
            }
            _ if self.lr.is_none() && self.min_lr.is_none() && self.warmup_steps.is_none() => {
                Ok(())
            }
            other => Err(TrainError::Config(format!(
                "--lr, --min-lr and --warmup-steps set a warm-up + cosine learning rate (--lr \
                 alone also a constant one), but the configuration's [train.lr] is {other:?}; \
                 change it in the --config file instead"
            ))),
        }
    }

    /// The configuration of this invocation: default, then `--config`, then the flags.
    pub fn resolve(&self) -> Result<BfppConfig, TrainError> {
        let mut cfg = match &self.config {
            Some(path) => BfppConfig::from_file(path)?,
            None => BfppConfig::default(),
        };
        self.apply(&mut cfg)?;
        Ok(cfg)
    }
}
