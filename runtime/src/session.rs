//! A generation session: the model's decode attention served by attnstore. Each layer's KV
//! lives in one engine context; every decode step appends the new token's K/V and runs one
//! plan per layer under the session's method and budget.

use crate::error::{Error, Result};
use crate::model::{argmax, AttentionBackend, Model, Prefill};
use attnstore::{
    AttnShape, Budget, Codec, ContextId, ContextSpec, Engine, EstimateShare, LayerCodecs, LayerKind, Method, PqParams,
    Request, Strategy, WaveParams,
};
use std::time::{Duration, Instant};

/// Which attnstore access method serves decode attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnMethod {
    /// Every token attended exactly (flat index, full budget).
    Exact,
    /// RetroInfer's wave index: steady + retrieved clusters + estimated clusters.
    Wave,
    /// PQCache: top-k of PQ-approximated scores.
    Pq,
    /// The oracle: top-k of true scores (flat index, sparse budget).
    TopK,
}

impl AttnMethod {
    /// Parses `exact|wave|pq|topk`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(Self::Exact),
            "wave" => Ok(Self::Wave),
            "pq" => Ok(Self::Pq),
            "topk" | "oracle" => Ok(Self::TopK),
            _ => Err(Error::InvalidInput(format!("unknown method {s:?}: expected exact, wave, pq or topk"))),
        }
    }

    /// Name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Exact => "exact",
            Self::Wave => "wave",
            Self::Pq => "pq",
            Self::TopK => "topk",
        }
    }

    /// The access method of the engine context that serves this method.
    pub(crate) fn spec_method(self) -> Method {
        match self {
            Self::Exact | Self::TopK => Method::Flat,
            Self::Wave => Method::Wave(WaveParams::default()),
            Self::Pq => Method::Pq(PqParams::default()),
        }
    }
}

/// Tokens retrieved at least by the runtime's default budget: twice the engine's 512. Over
/// three real texts at 8K tokens (189 teacher-forced positions, `docs/realmodel.md`) the
/// 512 floor agreed with exact attention on 96.8% of the next tokens, 1024 on 97.9% (KL
/// 0.0032 → 0.0009), attending 13.9% of the tokens exactly instead of 7.6%. Contexts past
/// 1024 / 1.8% ≈ 57K tokens are not affected.
pub const RETRIEVE_FLOOR_TOKENS: usize = 1024;

/// Contexts up to this many tokens are attended exactly by the runtime's default budget
/// (`Budget::short_context_tokens`). On SmolLM2 at 3.7K tokens a wave plan made generation
/// only ~5% faster than exact attention (the model's matmuls are 75% of a step, and a plan's
/// fixed costs are the order of exact attention over 3 KV heads), while at 4K over three
/// texts the default sparse plan agreed with exact on 96.3% of the next tokens
/// (`docs/realmodel.md`): below this length the trade is not worth it.
pub const SHORT_CONTEXT_TOKENS: usize = 6144;

/// The runtime's default budget: the engine's (1.8% retrieved, clusters chosen per KV head)
/// with a [`RETRIEVE_FLOOR_TOKENS`] floor, estimating every cluster that is not retrieved,
/// and exact plans up to [`SHORT_CONTEXT_TOKENS`].
/// On a real 3.6K-token SmolLM2 trace estimating all clusters cut the wave plans' attention
/// error from 0.068 to 0.058 for 2% more bytes (`docs/realmodel.md`); at these lengths the
/// value sums of all clusters are cheap.
pub fn default_budget() -> Budget {
    Budget::default()
        .with_estimate(EstimateShare::Rest)
        .with_retrieve_floor(RETRIEVE_FLOOR_TOKENS)
        .with_short_context(SHORT_CONTEXT_TOKENS)
}

/// How a session's codec table is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CodecPolicy {
    /// [`AttnConfig::codec`] as given.
    #[default]
    Fixed,
    /// `kv43` per layer chosen at prefill from the prompt's own KV and last queries, at a
    /// quarter of f16's bytes per token ([`crate::codec_policy::choose_kv43`]); `--codec
    /// kv43:auto` on the command line.
    Kv43Auto,
}

/// A method and the budget its plans run under.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnConfig {
    /// The access method.
    pub method: AttnMethod,
    /// The plan budget (ignored by `Exact`, which always plans the full budget).
    pub budget: Budget,
    /// Codec of the stored KV per layer (`hack2`: 2-bit indexed rows, f16 steady zone;
    /// `kv43:256:b128,3-10=kv43:v4`: 4-bit values in layers 3–10).
    pub codec: LayerCodecs,
    /// The first this many layers are always attended exactly (their attention is broad:
    /// on SmolLM2 layer 0 has 3-5x the sparse error of the median layer).
    pub dense_layers: usize,
    /// Whether `codec` is used as given or chosen at prefill ([`AttnConfig::resolve`]).
    pub codec_policy: CodecPolicy,
}

impl AttnConfig {
    /// `method` under the runtime's default budget ([`default_budget`]), f16 storage.
    pub fn new(method: AttnMethod) -> Self {
        Self {
            method,
            budget: default_budget(),
            codec: LayerCodecs::uniform(Codec::F16),
            dense_layers: 0,
            codec_policy: CodecPolicy::Fixed,
        }
    }

    /// This configuration with its codec table chosen for `prefill` of a model of `config`
    /// when its policy says so (the policy is then [`CodecPolicy::Fixed`]), and the choice;
    /// else itself and `None`.
    pub fn resolve(
        self,
        config: &crate::ModelConfig,
        prefill: &Prefill,
    ) -> Result<(Self, Option<crate::codec_policy::Kv43Choice>)> {
        match self.codec_policy {
            CodecPolicy::Fixed => Ok((self, None)),
            CodecPolicy::Kv43Auto => {
                let choice = crate::codec_policy::choose_kv43(config, prefill)?;
                Ok((Self { codec: choice.codecs, codec_policy: CodecPolicy::Fixed, ..self }, Some(choice)))
            }
        }
    }

    /// The budget scaled by `scale`: retrieval fraction and token floor (the estimation
    /// share is kept).
    pub fn scaled(mut self, scale: f64) -> Self {
        self.budget.retrieve_frac *= scale;
        self.budget.retrieve_floor_tokens = (self.budget.retrieve_floor_tokens as f64 * scale).round() as usize;
        self
    }

    /// The spec of the context that serves this configuration. Exact attention over
    /// encoded rows (`hack2`, `kv43`) runs on a wave context under a full budget (the
    /// encoded form lives in the indexed segments); the oracle top-k always keeps plain rows
    /// (f16 for the encoded codecs).
    pub(crate) fn spec(&self, shape: AttnShape, kinds: &[LayerKind]) -> ContextSpec {
        let base = ContextSpec::new(shape, kinds.len()).with_layers(kinds.to_vec());
        match (self.method, self.codec.is_encoded()) {
            (AttnMethod::Exact, true) => {
                base.with_layer_codecs(self.codec).with_method(Method::Wave(WaveParams::default()))
            }
            (AttnMethod::TopK, true) => {
                base.with_codec(Codec::from(self.codec.plain_dtype())).with_method(Method::Flat)
            }
            (m, _) => base.with_layer_codecs(self.codec).with_method(m.spec_method()),
        }
    }

    /// The budget of `layer`'s plans.
    pub fn layer_budget(&self, layer: usize) -> Budget {
        match self.method {
            AttnMethod::Exact => Budget::full(),
            _ if layer < self.dense_layers => Budget::full(),
            _ => self.budget,
        }
    }
}

/// What a session's decode steps did.
#[derive(Debug, Clone, Default)]
pub struct SessionStats {
    /// Decode steps run.
    pub steps: usize,
    /// Time in the model outside attention.
    pub model_time: Duration,
    /// Time in attnstore (append, plan, execute).
    pub attn_time: Duration,
    /// Sum over global-layer plans of the mean exactly attended tokens per query head
    /// (sliding-window layers always attend their window exactly and are not counted).
    pub exact_tokens: f64,
    /// Sum over global-layer plans of the context length.
    pub context_tokens: f64,
    /// Global-layer plans the planner made exact (short context, full budget, cheaper).
    pub exact_plans: usize,
    /// Global-layer plans in total.
    pub plans: usize,
    /// With an audit: per layer, the sum of relative L2 errors of the attention output vs
    /// exact attention over the same KV, and the number of steps summed.
    pub layer_error: Vec<f64>,
    /// Bytes the plans read (all tiers).
    pub bytes_read: f64,
}

impl SessionStats {
    /// Mean exactly attended tokens per query head per global-layer plan.
    pub fn mean_exact_tokens(&self) -> f64 {
        self.exact_tokens / self.plans.max(1) as f64
    }

    /// Mean share of the global layers' context attended exactly.
    pub fn exact_share(&self) -> f64 {
        self.exact_tokens / self.context_tokens.max(1.0)
    }

    /// Mean relative attention-output error per layer (empty without an audit).
    pub fn mean_layer_error(&self) -> Vec<f64> {
        self.layer_error.iter().map(|e| e / self.steps.max(1) as f64).collect()
    }
}

/// A model with its decode attention in an attnstore context.
pub struct Session<'a> {
    model: &'a Model,
    engine: &'a Engine,
    config: AttnConfig,
    ctx: ContextId,
    /// An exact twin context for per-layer error audits.
    audit: Option<ContextId>,
    pos: usize,
    stats: SessionStats,
    last_plan: Option<String>,
}

impl<'a> Session<'a> {
    /// Stores a prefilled prompt's KV in a new context of `engine` and returns a session
    /// positioned after the prompt. With `audit`, an exact twin context is kept and every
    /// step also measures the attention-output error per layer. PQ codebooks are waited for,
    /// so every decode plan runs on a ready index.
    pub fn new(
        model: &'a Model,
        engine: &'a Engine,
        config: AttnConfig,
        prefill: &Prefill,
        audit: bool,
    ) -> Result<Self> {
        config.budget.validate()?;
        let c = model.config();
        let (config, _) = config.resolve(c, prefill)?;
        let make = |spec: ContextSpec| {
            store_context(engine, spec, prefill.kv.iter().map(|(k, v)| (k.as_slice(), v.as_slice())))
        };
        let kinds = c.layer_kinds();
        let ctx = make(config.spec(c.attn_shape(), &kinds))?;
        let exact_twin = ContextSpec::new(c.attn_shape(), c.layers).with_layers(kinds).with_method(Method::Flat);
        let audit = if audit && (config.method != AttnMethod::Exact || config.codec.is_encoded()) {
            Some(make(exact_twin)?)
        } else {
            None
        };
        let stats =
            SessionStats { layer_error: vec![0.0; if audit.is_some() { c.layers } else { 0 }], ..Default::default() };
        Ok(Self { model, engine, config, ctx, audit, pos: prefill.tokens.len(), stats, last_plan: None })
    }

    /// A session over an existing context `ctx` of `engine` holding the KV of the first
    /// `pos` tokens, made under `config` (e.g. attached from the remote tier). No audit twin.
    pub(crate) fn resume(model: &'a Model, engine: &'a Engine, config: AttnConfig, ctx: ContextId, pos: usize) -> Self {
        Self { model, engine, config, ctx, audit: None, pos, stats: SessionStats::default(), last_plan: None }
    }

    /// Feeds `token` and returns the next-token logits.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let start = Instant::now();
        let attn_before = self.stats.attn_time;
        let model = self.model;
        let logits = model.decode_step(token, self.pos, self)?;
        self.pos += 1;
        self.stats.steps += 1;
        let attn = self.stats.attn_time - attn_before;
        self.stats.model_time += start.elapsed().saturating_sub(attn);
        Ok(logits)
    }

    /// Greedy generation: feeds `first` (usually the prompt's argmax) and the argmax of each
    /// step, up to `max` tokens or the end-of-turn token; returns the tokens and the logits
    /// that chose each of them after the first.
    pub fn greedy(&mut self, first: u32, max: usize, stop: Option<u32>) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(max);
        let mut next = first;
        while out.len() < max {
            out.push(next);
            if Some(next) == stop || out.len() == max {
                break;
            }
            next = argmax(&self.step(next)?);
        }
        Ok(out)
    }

    /// Tokens in the context (prompt + fed tokens).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// What the steps did so far.
    pub fn stats(&self) -> &SessionStats {
        &self.stats
    }

    /// EXPLAIN of the most recent plan of layer 0.
    pub fn last_explain(&self) -> Option<&str> {
        self.last_plan.as_deref()
    }

    /// The engine context holding the session's KV.
    pub fn context(&self) -> ContextId {
        self.ctx
    }

    /// Drops the session's contexts from the engine.
    pub fn close(self) -> Result<()> {
        self.engine.drop_context(self.ctx)?;
        if let Some(a) = self.audit {
            self.engine.drop_context(a)?;
        }
        Ok(())
    }
}

impl AttentionBackend for Session<'_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>> {
        let start = Instant::now();
        self.engine.append(self.ctx, layer, k, v)?;
        let plan = self.engine.plan(&[Request::new(self.ctx, layer, q.to_vec())], &self.config.layer_budget(layer))?;
        let out = self.engine.execute(&plan)?.pop().expect("one request, one output");
        let r = &plan.requests[0];
        let qh = r.shape.q_heads;
        self.stats.bytes_read += r.cost.total_bytes() as f64;
        if r.kind == LayerKind::Global {
            self.stats.plans += 1;
            self.stats.exact_tokens += (0..qh).map(|h| r.exact_tokens(h)).sum::<usize>() as f64 / qh as f64;
            self.stats.context_tokens += r.tokens as f64;
            if matches!(r.strategy, Strategy::Exact { .. }) {
                self.stats.exact_plans += 1;
            }
        }
        if layer == 0 {
            self.last_plan = Some(plan.explain());
        }
        self.stats.attn_time += start.elapsed();
        if let Some(audit) = self.audit {
            self.engine.append(audit, layer, k, v)?;
            let exact = self.engine.plan(&[Request::new(audit, layer, q.to_vec())], &Budget::full())?;
            let reference = self.engine.execute(&exact)?.pop().expect("one request, one output");
            self.stats.layer_error[layer] += relative_l2(&out, &reference);
        }
        Ok(out)
    }
}

/// Creates a context of `spec` in `engine`, prefills layer `l` with the `l`-th `(keys,
/// values)` and waits for background index builds (PQ codebooks), so every plan made on it
/// runs on a ready index.
pub(crate) fn store_context<K: AsRef<[f32]>, V: AsRef<[f32]>>(
    engine: &Engine,
    spec: ContextSpec,
    layers: impl IntoIterator<Item = (K, V)>,
) -> Result<ContextId> {
    let ctx = engine.create_context(spec)?;
    for (l, (k, v)) in layers.into_iter().enumerate() {
        engine.prefill(ctx, l, k.as_ref(), v.as_ref())?;
        engine.wait_index(ctx, l, Duration::from_secs(600))?;
    }
    Ok(ctx)
}

/// `‖a − b‖ / ‖b‖`.
pub fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += ((x - y) as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
