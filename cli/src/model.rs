//! The real-model commands: `generate`, `capture`, `eval`, `argmax`, and `bench --trace`.

use attnstore::remote::ModelId;
use attnstore::{Budget, Codec, EstimateShare, Kv43Params, LayerCodecs};
use attnstore_bench::plot::{Axis, Chart, Series};
use attnstore_runtime::eval::{self, EvalConfig, EvalRow, PasskeyRow};
use attnstore_runtime::synth::{write_model, SynthConfig};
use attnstore_runtime::trace::{self, Trace, TraceRow};
use attnstore_runtime::{
    argmax, default_model_path, remote, Arch, AttnConfig, AttnMethod, CodecPolicy, Model, Numerics, Session, Weights,
};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Model file and weight handling.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// The GGUF file (default: $ATTNSTORE_MODEL, else models/ as scripts/fetch-model puts it).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Weights: `quantized` (as stored, the reference numerics; default of generate, capture
    /// and argmax) or `f32` (dequantized at load: ~10x faster prompts, slightly different
    /// logits; default of eval, where quantized activations would turn 1e-7 differences
    /// between methods into different tokens).
    #[arg(long, value_parser = parse_weights)]
    weights: Option<Weights>,
    /// Prefill chunk (tokens; at least 1).
    #[arg(long, default_value_t = 256, value_parser = crate::parse_count)]
    chunk: usize,
}

/// Budget knobs shared by the model commands.
#[derive(Args, Clone)]
pub struct ModelBudgetArgs {
    /// Fraction of tokens attended exactly in the retrieval zone.
    #[arg(long, default_value_t = Budget::default().retrieve_frac)]
    retrieve: f64,
    /// Minimum tokens in the retrieval zone (the runtime's default, twice the engine's: see
    /// docs/realmodel.md).
    #[arg(long, default_value_t = attnstore_runtime::default_budget().retrieve_floor_tokens)]
    retrieve_floor: usize,
    /// Contexts up to this many tokens are planned exact (the runtime's default, see
    /// docs/realmodel.md; 0 turns the rule off).
    #[arg(long, default_value_t = attnstore_runtime::default_budget().short_context_tokens)]
    short_context: usize,
    /// Estimation share: a fraction of tokens, or `rest` (every cluster not retrieved; the
    /// runtime's default, measured in docs/realmodel.md).
    #[arg(long, default_value = "rest", value_parser = crate::parse_share)]
    estimate: EstimateShare,
    /// Codec of the stored KV: f16 (default), or hack2 / hack2:Π (2-bit homomorphic rows,
    /// HACK's per-token keys), hack2c / hack2c:Π (keys normalized per channel first),
    /// kv43 (4-bit per-channel keys over 128-token groups, 3-bit values over 64-token blocks;
    /// not with pq) with any of :kB (key bits, 4 or 5), :vB (value bits, 3 or 4), :G or :gG
    /// (key group), :bN (value block); then optionally a codec per range of layers, e.g.
    /// `kv43:256:b128,3-10=kv43:v4`; with `exact`, exact attention over the encoded rows.
    /// `kv43:auto` chooses a kv43 codec per layer at prefill from the prompt's own KV and
    /// last queries, at a quarter of f16's bytes (attnstore_runtime::codec_policy).
    #[arg(long, default_value = "f16", value_parser = parse_codec)]
    codec: (LayerCodecs, CodecPolicy),
}

/// `--codec`: a codec table, or `kv43:auto` (kv43 per layer chosen at prefill).
fn parse_codec(s: &str) -> Result<(LayerCodecs, CodecPolicy), String> {
    match s {
        "kv43:auto" => Ok((LayerCodecs::uniform(Codec::Kv43(Kv43Params::default())), CodecPolicy::Kv43Auto)),
        _ => Ok((s.parse::<LayerCodecs>().map_err(|e| e.to_string())?, CodecPolicy::Fixed)),
    }
}

impl ModelBudgetArgs {
    fn budget(&self) -> Result<Budget, String> {
        let b = Budget::default()
            .with_retrieve(self.retrieve)
            .with_retrieve_floor(self.retrieve_floor)
            .with_short_context(self.short_context)
            .with_estimate(self.estimate);
        b.validate().map_err(|e| e.to_string())?;
        Ok(b)
    }
}

/// `attnstore generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Access method: exact, wave, pq or topk (the oracle).
    #[arg(long, default_value = "wave", value_parser = parse_method)]
    method: AttnMethod,
    /// The prompt (a user turn; the chat template is applied unless --raw).
    #[arg(long)]
    prompt_file: PathBuf,
    /// Tokens to generate at most (at least 1; with the prompt they must fit in the model's
    /// context).
    #[arg(long, default_value_t = 128, value_parser = crate::parse_count)]
    max_tokens: usize,
    /// Feed the file's text as is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Print the EXPLAIN of the last decode step's layer-0 plan.
    #[arg(long)]
    explain: bool,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    budget: ModelBudgetArgs,
    #[command(flatten)]
    remote: crate::remote::RemoteArgs,
}

/// `attnstore capture`.
#[derive(Args)]
pub struct CaptureArgs {
    /// The prompt (a user turn; the chat template is applied unless --raw).
    #[arg(long)]
    prompt_file: PathBuf,
    /// The trace directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Decode steps whose queries are captured.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Feed the file's text as is, without the chat template.
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    model: ModelArgs,
}

/// `attnstore eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// Prompt lengths for agreement and attention error (K suffix allowed).
    #[arg(long, default_value = "2K,4K,8K", value_delimiter = ',', value_parser = crate::parse_tokens)]
    lengths: Vec<usize>,
    /// Methods compared with exact attention: wave, pq, topk (or oracle: top-k of the true
    /// scores), and exact, which adds rows only with an encoded --codec (exact attention
    /// over the hack2 or kv43 rows; over f16 it is the reference itself and is skipped).
    #[arg(long, default_value = "wave,pq,topk", value_delimiter = ',', value_parser = parse_method)]
    methods: Vec<AttnMethod>,
    /// Budget scales relative to the default budget (each positive: retrieval fraction and
    /// token floor are multiplied by it).
    #[arg(long, default_value = "0.5,1,2", value_delimiter = ',', value_parser = parse_scale)]
    scales: Vec<f64>,
    /// Tokens of the exact continuation (teacher-forced and free-running agreement): at
    /// least 2, since the first comes from the prompt's logits and agreement is measured
    /// from the second on.
    #[arg(long, default_value_t = 64, value_parser = parse_gen_tokens)]
    gen_tokens: usize,
    /// Skip the passkey test.
    #[arg(long)]
    skip_passkey: bool,
    /// Summarize this text file instead of the built-in paper (rows name it by file stem).
    #[arg(long)]
    summary_text: Option<std::path::PathBuf>,
    /// Passkey prompt lengths.
    #[arg(long, default_value = "1K,2K,4K,8K", value_delimiter = ',', value_parser = crate::parse_tokens)]
    passkey_lengths: Vec<usize>,
    /// Needle depths: where the secret number sits in the haystack, as a fraction of it
    /// (0 at the start, 1 at the end), each in 0..=1; one passkey trial per depth.
    #[arg(long, default_value = "0.1,0.5,0.9", value_delimiter = ',', value_parser = parse_depth)]
    passkey_depths: Vec<f64>,
    /// Seed of the pass keys.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Also write the JSON lines to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Write charts into this directory (SVG and PNG): per length attention error against
    /// exactly attended tokens (top-k is the oracle's curve), and KL, top-1 agreement and
    /// passkey retrieval against prompt length.
    #[arg(long)]
    plot: Option<PathBuf>,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    budget: ModelBudgetArgs,
}

/// `attnstore argmax`: teacher-forced argmax for the llama.cpp cross-check.
#[derive(Args)]
pub struct ArgmaxArgs {
    /// The prompt (a user turn; the chat template is applied).
    #[arg(long)]
    prompt_file: PathBuf,
    /// Tokens of the exact greedy continuation to teacher-force.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Teacher-force pseudo-random token ids (seeded, spread over the vocabulary) instead of
    /// the greedy continuation: models with random weights (`synth-model`) repeat one token
    /// greedily, which checks little.
    #[arg(long)]
    random_tokens: bool,
    /// Teacher-force the continuation recorded in this earlier `argmax` output (same model
    /// and prompt) instead of this run's own greedy one: two numerics compared on the same
    /// tokens.
    #[arg(long, value_name = "FILE", conflicts_with = "random_tokens")]
    teacher_tokens: Option<PathBuf>,
    /// Rounding of the forward: `ggml` (llama.cpp's CPU roundings, what the check compares
    /// against) or `f32`.
    #[arg(long, default_value = "ggml", value_parser = parse_numerics)]
    numerics: Numerics,
    /// Who attends at the teacher-forced positions: `engine` (attnstore's exact plan, as
    /// `generate` decodes) or `model` (the runtime's own causal attention, the prefill's
    /// arithmetic, as llama.cpp computes every position of a batch; under `ggml` numerics its
    /// probabilities are rounded to f16 like llama.cpp's).
    #[arg(long, default_value = "engine", value_parser = parse_decode)]
    decode: ArgmaxDecode,
    /// Also the argmax after every prompt prefix (the prompt's teacher-forced positions, from
    /// the prompt's prefill), before the continuation's.
    #[arg(long)]
    prompt_positions: bool,
    /// The JSON file to write.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

/// Who attends at `attnstore argmax`'s teacher-forced positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgmaxDecode {
    /// attnstore's exact plan, through a session.
    Engine,
    /// The runtime's own causal attention, one token at a time after the prompt's KV.
    Model,
}

fn parse_decode(s: &str) -> Result<ArgmaxDecode, String> {
    match s.to_ascii_lowercase().as_str() {
        "engine" => Ok(ArgmaxDecode::Engine),
        "model" => Ok(ArgmaxDecode::Model),
        _ => Err(format!("unknown decode {s:?}: expected engine or model")),
    }
}

/// `attnstore synth-model`: a small model with random weights (tests, llama.cpp checks).
#[derive(Args)]
pub struct SynthArgs {
    /// Architecture: llama, qwen2 or gemma3.
    #[arg(long, value_parser = parse_arch)]
    arch: Arch,
    /// Seed of the weights.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The GGUF file to write.
    #[arg(long)]
    out: PathBuf,
}

fn parse_arch(s: &str) -> Result<Arch, String> {
    Arch::parse(s.trim()).map_err(|e| e.to_string())
}

/// Writes [`SynthArgs::out`].
pub fn synth_model(args: SynthArgs) -> Result<(), String> {
    let config = SynthConfig { seed: args.seed, ..SynthConfig::small(args.arch) };
    write_model(&args.out, &config).map_err(|e| e.to_string())?;
    println!("wrote {} ({config:?})", args.out.display());
    Ok(())
}

fn parse_numerics(s: &str) -> Result<Numerics, String> {
    match s.to_ascii_lowercase().as_str() {
        "ggml" => Ok(Numerics::Ggml),
        "f32" => Ok(Numerics::F32),
        _ => Err(format!("unknown numerics {s:?}: expected ggml or f32")),
    }
}

fn parse_weights(s: &str) -> Result<Weights, String> {
    match s.trim() {
        "quantized" | "q" => Ok(Weights::Quantized),
        "f32" | "dequantized" => Ok(Weights::Dequantized),
        other => Err(format!("unknown weights {other:?}: expected quantized or f32")),
    }
}

fn parse_method(s: &str) -> Result<AttnMethod, String> {
    AttnMethod::parse(s.trim()).map_err(|e| e.to_string())
}

/// A budget scale: finite and positive.
pub(crate) fn parse_scale(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(x) => Err(format!("budget scale {x} must be a positive number (1 is the default budget)")),
        Err(_) => Err(format!("{s:?} is not a budget scale: expected a positive number such as 0.5, 1 or 2")),
    }
}

/// A needle depth: a fraction of the haystack in 0..=1.
fn parse_depth(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        Ok(x) => Err(format!(
            "passkey depth {x} is outside 0..=1: a depth is the fraction of the haystack before the needle \
             (0 at the start, 1 at the end)"
        )),
        Err(_) => Err(format!("{s:?} is not a passkey depth: expected a fraction in 0..=1 such as 0.5")),
    }
}

/// Tokens of the exact continuation: at least 2 (the first token comes from the prompt's
/// logits; teacher-forced agreement is measured from the second on).
fn parse_gen_tokens(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= 2 => Ok(n),
        Ok(n) => Err(format!(
            "{n} generated tokens leave nothing to compare: at least 2 are needed (the first comes from the \
             prompt, agreement is measured from the second on)"
        )),
        Err(_) => Err(format!("{s:?} is not a token count: expected a whole number of at least 2")),
    }
}

/// The text of a prompt file, checked before the model is loaded: readable, UTF-8 and not
/// blank.
fn read_prompt(file: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("prompt file {}: {e}", file.display()))?;
    if text.trim().is_empty() {
        return Err(format!("prompt file {} is empty: the prompt needs at least one token", file.display()));
    }
    Ok(text)
}

/// The GGUF file `--model` names, else the default model.
fn model_path(args: &ModelArgs) -> PathBuf {
    args.model.clone().unwrap_or_else(default_model_path)
}

fn load(args: &ModelArgs, default: Weights) -> Result<Model, String> {
    let path = model_path(args);
    let start = Instant::now();
    let weights = args.weights.unwrap_or(default);
    let model = Model::load(&path, weights).map_err(|e| e.to_string())?;
    eprintln!("loaded {} ({weights:?} weights) in {:.1} s", path.display(), start.elapsed().as_secs_f64());
    Ok(model)
}

/// Token ids of a prompt text (from [`read_prompt`]), inside the chat template unless `raw`,
/// after the BOS token where the model has one.
fn prompt_ids(model: &Model, text: &str, raw: bool) -> Result<Vec<u32>, String> {
    let text = if raw { text.to_string() } else { model.tokenizer().chat_prompt(text.trim()) };
    model.tokenizer().encode_prompt(&text).map_err(|e| e.to_string())
}

fn bar(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template(&format!("{what} {{bar:40}} {{pos}}/{{len}} tokens ({{per_sec}}, eta {{eta}})"))
            .expect("valid template"),
    );
    pb
}

fn prefill(model: &Model, ids: &[u32], chunk: usize) -> Result<attnstore_runtime::Prefill, String> {
    timed_prefill(ids, |progress| model.prefill(ids, chunk, progress))
}

/// `run` (a prefill of `ids`, reporting tokens done to its argument) under a progress bar,
/// its speed printed after.
fn timed_prefill<T>(
    ids: &[u32],
    run: impl FnOnce(&mut dyn FnMut(usize)) -> attnstore_runtime::Result<T>,
) -> Result<T, String> {
    let pb = bar(ids.len(), "prefill");
    let start = Instant::now();
    let p = run(&mut |n| pb.set_position(n as u64)).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let s = start.elapsed().as_secs_f64();
    eprintln!("prefill: {} tokens in {s:.1} s ({:.0} tokens/s)", ids.len(), ids.len() as f64 / s);
    Ok(p)
}

/// `attnstore generate`.
pub fn generate(args: GenerateArgs) -> Result<(), String> {
    // Everything that can be checked without the model is checked before loading it.
    let (codec, codec_policy) = args.budget.codec;
    let config = AttnConfig { budget: args.budget.budget()?, codec, codec_policy, ..AttnConfig::new(args.method) };
    let text = read_prompt(&args.prompt_file)?;
    let model = load(&args.model, Weights::Quantized)?;
    let ids = prompt_ids(&model, &text, args.raw)?;
    // The last generated token is not fed back: prompt + max_tokens - 1 positions are used.
    let context = model.config().context_length;
    if ids.len() > context {
        return Err(format!("the prompt's {} tokens exceed the model's context of {context} tokens", ids.len()));
    }
    if ids.len() + args.max_tokens - 1 > context {
        return Err(format!(
            "the prompt's {} tokens and --max-tokens {} exceed the model's context of {context} tokens: \
             at most {} tokens can be generated after this prompt",
            ids.len(),
            args.max_tokens,
            (context + 1).saturating_sub(ids.len())
        ));
    }
    let engine = attnstore::Engine::in_memory(attnstore::EngineConfig::default()).map_err(|e| e.to_string())?;
    let tier = match &args.remote.remote {
        Some(url) => match args.remote.tier(url) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("warning: {e}: prefilling the whole prompt without the remote tier");
                None
            }
        },
        None => None,
    };
    let (mut session, logits) = match &tier {
        None => {
            let p = prefill(&model, &ids, args.model.chunk)?;
            let session = Session::new(&model, &engine, config, &p, false).map_err(|e| e.to_string())?;
            (session, p.logits)
        }
        Some(tier) => {
            let start = Instant::now();
            let id = ModelId::of_file(&model_path(&args.model)).map_err(|e| e.to_string())?;
            let hashed = start.elapsed().as_secs_f64();
            let pb = bar(ids.len(), "prefill");
            let r = remote::start(&model, &engine, config, tier, &id, &ids, args.model.chunk, &mut |n| {
                pb.set_position(n as u64)
            })
            .map_err(|e| e.to_string())?;
            pb.finish_and_clear();
            let (a, p) = (r.attach_time.as_secs_f64(), r.prefill_time.as_secs_f64());
            eprintln!(
                "time to first token: {:.2} s ({} of {} prompt tokens attached from {} in {a:.2} s, {} prefilled in {p:.2} s; \
                 model identity {} hashed in {hashed:.2} s)",
                a + p,
                r.reused_tokens,
                ids.len(),
                tier.describe(),
                r.prefilled_tokens,
                &id.hex()[..16],
            );
            (r.session, r.logits)
        }
    };
    let tok = model.tokenizer();
    let start = Instant::now();
    let mut next = argmax(&logits);
    let mut out = Vec::new();
    let mut stdout = std::io::stdout();
    let mut printed = String::new();
    while out.len() < args.max_tokens && next != tok.eos() {
        out.push(next);
        let text = tok.decode(&out).map_err(|e| e.to_string())?;
        // Print what is new; a multi-byte character may finish one token later.
        if let Some(fresh) = text.strip_prefix(printed.as_str()) {
            let _ = write!(stdout, "{fresh}");
            let _ = stdout.flush();
            printed = text;
        }
        if out.len() == args.max_tokens {
            break;
        }
        next = argmax(&session.step(next).map_err(|e| e.to_string())?);
    }
    println!();
    let secs = start.elapsed().as_secs_f64();
    let st = session.stats();
    eprintln!(
        "{} tokens in {secs:.1} s: {:.1} tokens/s at {} context tokens; attention {:.0}% of decode time \
         ({:.1} ms/token in attnstore); method {}, {:.0} exact tokens per head ({:.1}% of the context), {} of {} layer plans exact",
        out.len(),
        out.len() as f64 / secs,
        session.position(),
        100.0 * st.attn_time.as_secs_f64() / (st.attn_time + st.model_time).as_secs_f64().max(1e-9),
        1e3 * st.attn_time.as_secs_f64() / st.steps.max(1) as f64,
        args.method.name(),
        st.mean_exact_tokens(),
        100.0 * st.exact_share(),
        st.exact_plans,
        st.plans
    );
    if args.explain {
        if let Some(e) = session.last_explain() {
            eprintln!("{e}");
        }
    }
    if let Some(tier) = &tier {
        if !tier.flush(Duration::from_secs(60)) {
            eprintln!("warning: the prompt's publish did not finish within 60 s; what was written stays usable");
        }
        eprintln!("{}", tier.stats().summary());
    }
    Ok(())
}

/// `attnstore capture`.
pub fn capture(args: CaptureArgs) -> Result<(), String> {
    let text = read_prompt(&args.prompt_file)?;
    let model = load(&args.model, Weights::Quantized)?;
    let ids = prompt_ids(&model, &text, args.raw)?;
    let pb = bar(ids.len(), "prefill");
    let meta =
        trace::capture(&model, &ids, args.model.chunk, args.steps, &args.out, &mut |n| pb.set_position(n as u64))
            .map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let bytes: u64 = meta.files.values().map(|f| f.bytes).sum();
    println!(
        "wrote {}: {} layers, {} prompt tokens, {} decode steps, {:.1} MB",
        args.out.display(),
        meta.layers,
        meta.prompt_tokens,
        meta.decode_steps,
        bytes as f64 / 1e6
    );
    Ok(())
}

/// `attnstore bench --trace DIR`.
pub fn bench_trace(
    dir: &std::path::Path,
    bases: &[Budget],
    dense_layers: usize,
    codec: Codec,
    json: bool,
) -> Result<(), String> {
    let t = Trace::load(dir).map_err(|e| e.to_string())?;
    let m = &t.meta;
    if !json {
        println!(
            "attnstore bench on the trace {} ({}: {} layers, {} q / {} kv heads, d={}, {} prompt tokens, {} decode steps)",
            dir.display(),
            m.model,
            m.layers,
            m.q_heads,
            m.kv_heads,
            m.head_dim,
            m.prompt_tokens,
            m.decode_steps
        );
    }
    // A 2-bit codec is measured next to f16 in the same run, so its cost is read off directly.
    let mut configs = trace::configs_for(bases, dense_layers, Codec::F16.into());
    if codec != Codec::F16 {
        configs.extend(trace::configs_for(bases, dense_layers, codec.into()));
    }
    let rows =
        trace::bench_trace(&t, &configs, &mut |what| eprintln!("evaluating {what}")).map_err(|e| e.to_string())?;
    if !json {
        println!("{}", trace_table(&rows));
        println!("JSON lines:");
    }
    for r in &rows {
        println!("{}", serde_json::to_string(r).expect("rows serialize"));
    }
    Ok(())
}

fn trace_table(rows: &[TraceRow]) -> String {
    let mut s = format!(
        "{:<6} {:<6} {:>6} {:>8} {:>14} {:>5} {:>10} {:>8} {:>12} {:>8} {:>10} {:>11}\n",
        "method",
        "codec",
        "budget",
        "estimate",
        "selection",
        "dense",
        "rel error",
        "recall",
        "exact tokens",
        "share",
        "bytes/exact",
        "exact plans"
    );
    for r in rows {
        s += &format!(
            "{:<6} {:<6} {:>5}x {:>8} {:>14} {:>5} {:>10.4} {:>8.3} {:>12.0} {:>7.1}% {:>10.3} {:>5}/{:<5}\n",
            r.method,
            r.codec,
            r.budget_scale,
            r.estimate,
            r.selection,
            r.dense_layers,
            r.rel_error,
            r.recall,
            r.exact_tokens,
            100.0 * r.exact_share,
            r.bytes_ratio,
            r.exact_plans,
            r.plans
        );
    }
    s
}

/// `attnstore eval`.
pub fn eval(args: EvalArgs) -> Result<(), String> {
    // Everything that can be checked without the model is checked before loading it (the
    // parsers have checked scales, depths and --gen-tokens).
    let base = args.budget.budget()?;
    let mut variants = Vec::new();
    let (codec, codec_policy) = args.budget.codec;
    for &m in &args.methods {
        // Exact attention is the reference; over an encoded codec it is a variant of its own.
        if m == AttnMethod::Exact && !codec.is_encoded() {
            continue;
        }
        for &s in &args.scales {
            let config = AttnConfig { budget: base, codec, codec_policy, ..AttnConfig::new(m) }.scaled(s);
            config.budget.validate().map_err(|e| format!("budget scale {s}: {e}"))?;
            variants.push((config, s));
        }
    }
    if variants.is_empty() {
        return Err(format!(
            "--methods {} leaves nothing to compare with exact attention over {codec}: name wave, pq or topk \
             (exact is a variant only with an encoded --codec such as hack2 or kv43)",
            args.methods.iter().map(|m| m.name()).collect::<Vec<_>>().join(",")
        ));
    }
    let summary_text = match &args.summary_text {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let name = path.file_stem().map_or_else(|| "text".into(), |s| s.to_string_lossy().into_owned());
            Some((name, text))
        }
        None => None,
    };
    let json_file = match &args.json_out {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    let model = load(&args.model, Weights::Dequantized)?;
    let context = model.config().context_length;
    if args.gen_tokens >= context {
        return Err(format!(
            "--gen-tokens {} leaves no room for a prompt in the model's context of {context} tokens",
            args.gen_tokens
        ));
    }
    let config = EvalConfig {
        lengths: args.lengths,
        variants,
        gen_tokens: args.gen_tokens,
        passkey_lengths: if args.skip_passkey { Vec::new() } else { args.passkey_lengths },
        passkey_depths: args.passkey_depths,
        seed: args.seed,
        chunk: args.model.chunk,
        summary_text,
    };
    let json_file = std::cell::RefCell::new(json_file);
    let emit = |line: String| {
        eprintln!("result: {line}");
        if let Some(f) = json_file.borrow_mut().as_mut() {
            let _ = writeln!(f, "{line}");
        }
    };
    let start = Instant::now();
    let (rows, passkeys) = eval::run(
        &model,
        &config,
        &mut |what| eprintln!("[{:>6.0} s] {what}", start.elapsed().as_secs_f64()),
        &mut |r: &EvalRow| emit(serde_json::to_string(r).expect("serializes")),
        &mut |r: &PasskeyRow| emit(serde_json::to_string(r).expect("serializes")),
    )
    .map_err(|e| e.to_string())?;
    println!("{}", eval_table(&rows));
    println!("{}", passkey_table(&passkeys));
    println!("weights: {:?}; {:.0} s in all", model.weights(), start.elapsed().as_secs_f64());
    if let Some(dir) = &args.plot {
        crate::write_charts(dir, eval_charts(&rows, &passkeys))?;
    }
    Ok(())
}

/// The charts of an `attnstore eval` run (see `EvalArgs::plot`).
fn eval_charts(rows: &[EvalRow], passkeys: &[PasskeyRow]) -> Vec<(String, Chart)> {
    let variant = |method: &str, codec: &str, scale: f64| format!("{method}/{codec} {scale}x");
    let mut charts = Vec::new();
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.length).collect();
    lengths.sort_unstable();
    lengths.dedup();
    for &len in &lengths {
        let mut by: BTreeMap<(String, bool), Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.length == len) {
            let oracle = r.method == AttnMethod::TopK.name();
            by.entry((format!("{}/{}", r.method, r.codec), oracle)).or_default().push((r.exact_tokens, r.attn_error));
        }
        let series = by
            .into_iter()
            .map(|((name, oracle), p)| match oracle {
                true => Series::new(format!("{name} (oracle)"), p).reference(),
                false => Series::new(name, p),
            })
            .collect();
        charts.push((
            format!("eval_frontier_{len}"),
            Chart {
                title: format!("Attention error against exact tokens, {len}-token prompts"),
                x: Axis::log("tokens attended exactly per query head and layer"),
                y: Axis::log("relative L2 error of attention outputs"),
                series,
            },
        ));
    }
    let per_length = |f: &dyn Fn(&EvalRow) -> f64| -> Vec<Series> {
        let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for r in rows {
            by.entry(variant(r.method, &r.codec, r.budget_scale)).or_default().push((r.length as f64, f(r)));
        }
        by.into_iter().map(|(n, p)| Series::new(n, p)).collect()
    };
    charts.push((
        "eval_kl".into(),
        Chart {
            title: "KL(exact ‖ method) of next-token distributions".into(),
            x: Axis::log("prompt tokens"),
            y: Axis::log("mean KL, teacher-forced"),
            series: per_length(&|r| r.kl),
        },
    ));
    charts.push((
        "eval_top1".into(),
        Chart {
            title: "Top-1 agreement with exact attention".into(),
            x: Axis::log("prompt tokens"),
            y: Axis::linear("teacher-forced top-1 agreement"),
            series: per_length(&|r| r.teacher_top1),
        },
    ));
    if !passkeys.is_empty() {
        let mut by: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for p in passkeys {
            let share = p.correct as f64 / p.trials.max(1) as f64;
            by.entry(variant(p.method, &p.codec, p.budget_scale)).or_default().push((p.length as f64, share));
        }
        charts.push((
            "eval_passkey".into(),
            Chart {
                title: "Passkey retrieval".into(),
                x: Axis::log("prompt tokens"),
                y: Axis::linear("share of pass keys retrieved"),
                series: by.into_iter().map(|(n, p)| Series::new(n, p)).collect(),
            },
        ));
    }
    charts
}

fn eval_table(rows: &[EvalRow]) -> String {
    let mut s = format!(
        "{:>6} {:<12} {:>6} {:>7} {:>15} {:>7} {:>7} {:>6} {:>9} {:>8} {:>7} {:>6} {:>14} {:>15}\n",
        "tokens",
        "method/codec",
        "budget",
        "top-1",
        "decisive (ties)",
        "KL",
        "free",
        "1st≠",
        "attn err",
        "exact tk",
        "share",
        "exact%",
        "tok/s (exact)",
        "B/tok (all lyr)"
    );
    for r in rows {
        s += &format!(
            "{:>6} {:<12} {:>5}x {:>6.1}% {:>9.1}% ({:>2}) {:>7.4} {:>6.1}% {:>6} {:>9.4} {:>8.0} {:>6.1}% {:>5.0}% {:>6.1} ({:>5.1}) {:>7.0} ({:>5.0})\n",
            r.length,
            format!("{}/{}", r.method, r.codec),
            r.budget_scale,
            100.0 * r.teacher_top1,
            100.0 * r.teacher_top1_decisive,
            r.near_ties,
            r.kl,
            100.0 * r.free_agreement,
            r.first_difference.map_or("-".to_string(), |i| i.to_string()),
            r.attn_error,
            r.exact_tokens,
            100.0 * r.exact_share,
            100.0 * r.exact_plan_share,
            r.tokens_per_s,
            r.exact_tokens_per_s,
            r.kept_bytes_per_token,
            r.all_layers_bytes_per_token
        );
    }
    s
}

fn passkey_table(rows: &[PasskeyRow]) -> String {
    let mut s = format!("{:>6} {:<12} {:>6} {:>8}  answers\n", "tokens", "method/codec", "budget", "passkey");
    for r in rows {
        s += &format!(
            "{:>6} {:<12} {:>5}x {:>4}/{:<3}  {}\n",
            r.length,
            format!("{}/{}", r.method, r.codec),
            r.budget_scale,
            r.correct,
            r.trials,
            r.answers.join(" | ")
        );
    }
    s
}

/// `attnstore argmax`: the exact method's greedy continuation, then per position of prompt
/// and continuation the teacher-forced argmax, written as JSON for scripts/llamacpp-check.
pub fn argmax_dump(args: ArgmaxArgs) -> Result<(), String> {
    let text = read_prompt(&args.prompt_file)?;
    let path = model_path(&args.model);
    let model = load(&args.model, Weights::Quantized)?.with_numerics(args.numerics).map_err(|e| e.to_string())?;
    let ids = prompt_ids(&model, &text, false)?;
    let teacher = args.teacher_tokens.as_deref().map(|f| teacher_continuation(f, &ids)).transpose()?;
    // With --prompt-positions the same prefill gives the argmax after every prompt prefix.
    let (p, prompt_argmax) = match args.prompt_positions {
        true => {
            let (p, best) = timed_prefill(&ids, |progress| model.prefill_argmax(&ids, args.model.chunk, progress))?;
            (p, Some(best))
        }
        false => (prefill(&model, &ids, args.model.chunk)?, None),
    };
    let engine = attnstore::Engine::in_memory(attnstore::EngineConfig::default()).map_err(|e| e.to_string())?;
    let mut s =
        Session::new(&model, &engine, AttnConfig::new(AttnMethod::Exact), &p, false).map_err(|e| e.to_string())?;
    // `fed[i]` follows the prompt at position `ids.len() + i`; `cont[i]` is the argmax after
    // the prompt and `fed[..i]` (for the greedy continuation the two are the same tokens).
    let forced = match teacher {
        Some(t) => Some(t.into_iter().take(args.max_tokens.saturating_sub(1)).collect::<Vec<u32>>()),
        None if args.random_tokens => {
            let vocab = model.config().vocab as u64;
            Some(
                (0..args.max_tokens.saturating_sub(1) as u64)
                    .map(|i| ((i * 2_654_435_761 + 97) % vocab) as u32)
                    .collect(),
            )
        }
        None => None,
    };
    // The next-token logits after feeding `t`, by the chosen attention.
    let mut past = p.kv.clone();
    let mut pos = ids.len();
    let mut step = |t: u32| -> Result<Vec<f32>, String> {
        match args.decode {
            ArgmaxDecode::Engine => s.step(t).map_err(|e| e.to_string()),
            ArgmaxDecode::Model => {
                let next = model.prefill_after(&past, pos, &[t], 1, false, &mut |_| {}).map_err(|e| e.to_string())?;
                (past, pos) = (next.kv, pos + 1);
                Ok(next.logits)
            }
        }
    };
    let mut cont = vec![argmax(&p.logits)];
    let fed = match forced {
        Some(fed) => {
            for &t in &fed {
                cont.push(argmax(&step(t)?));
            }
            fed
        }
        None => {
            while cont.len() < args.max_tokens {
                let t = *cont.last().expect("cont holds the first token");
                cont.push(argmax(&step(t)?));
            }
            cont.clone()
        }
    };
    let mut tokens = ids.clone();
    tokens.extend(&fed);
    // The prompt's own positions first (their last one is the continuation's first).
    let (argmax_from, cont) = match prompt_argmax {
        Some(mut all) => {
            all.pop();
            all.extend(cont);
            (0, all)
        }
        None => (ids.len() - 1, cont),
    };
    let value = serde_json::json!({
        "model": path.file_stem().map(|s| s.to_string_lossy().into_owned()),
        "arch": model.config().arch.name(),
        "weights": format!("{:?}", model.weights()),
        "numerics": format!("{:?}", model.numerics()),
        "decode": format!("{:?}", args.decode),
        "tokens": tokens,
        "prompt_tokens": ids.len(),
        "argmax_from": argmax_from,
        "argmax": cont,
        "prompt_text": model.tokenizer().chat_prompt(text.trim()),
        "add_bos": model.tokenizer().bos().is_some(),
    });
    std::fs::write(&args.out, serde_json::to_vec(&value).expect("serializes"))
        .map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!("wrote {} ({} prompt tokens, {} teacher-forced positions)", args.out.display(), ids.len(), cont.len());
    Ok(())
}

/// The continuation an earlier `argmax` output teacher-forced after `prompt` (which must be
/// its prompt too): its tokens past the prompt.
fn teacher_continuation(file: &Path, prompt: &[u32]) -> Result<Vec<u32>, String> {
    let bad = |why: String| format!("{}: {why}", file.display());
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(file).map_err(|e| bad(e.to_string()))?)
        .map_err(|e| bad(e.to_string()))?;
    let tokens: Vec<u32> = v["tokens"]
        .as_array()
        .and_then(|a| a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect())
        .ok_or_else(|| bad("expected \"tokens\", an array of token ids (an `attnstore argmax --out` file)".into()))?;
    let n = v["prompt_tokens"].as_u64().ok_or_else(|| bad("expected \"prompt_tokens\"".into()))? as usize;
    if n > tokens.len() || tokens[..n] != *prompt {
        return Err(bad(format!("its prompt ({n} tokens) is not this prompt ({} tokens)", prompt.len())));
    }
    Ok(tokens[n..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn teacher_tokens_come_from_an_argmax_file_of_the_same_prompt_and_bad_files_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.json");
        let write = |v: serde_json::Value| std::fs::write(&file, v.to_string()).unwrap();
        write(serde_json::json!({"tokens": [1, 2, 3, 7, 8], "prompt_tokens": 3}));
        assert_eq!(teacher_continuation(&file, &[1, 2, 3]).unwrap(), vec![7, 8]);
        let other = teacher_continuation(&file, &[1, 2, 4]).unwrap_err();
        assert!(other.contains("is not this prompt"), "{other}");
        write(serde_json::json!({"tokens": "x", "prompt_tokens": 3}));
        assert!(teacher_continuation(&file, &[1, 2, 3]).unwrap_err().contains("array of token ids"));
        write(serde_json::json!({"tokens": [1, 2, 3]}));
        assert!(teacher_continuation(&file, &[1, 2, 3]).unwrap_err().contains("prompt_tokens"));
        write(serde_json::json!({"tokens": [1], "prompt_tokens": 3}));
        assert!(teacher_continuation(&file, &[1, 2, 3]).unwrap_err().contains("is not this prompt"));
        std::fs::write(&file, "not json").unwrap();
        assert!(teacher_continuation(&file, &[1]).unwrap_err().contains("t.json"));
        assert!(teacher_continuation(&dir.path().join("missing.json"), &[1]).is_err());
        assert!(parse_numerics("GGML").is_ok() && parse_numerics("f16").unwrap_err().contains("expected ggml or f32"));
    }

    #[test]
    fn eval_rows_become_a_frontier_per_length_kl_top1_and_passkey_charts() {
        let row = |length, method, scale, exact_tokens, attn_error, kl| EvalRow {
            length,
            method,
            codec: "f16".into(),
            budget_scale: scale,
            exact_tokens,
            attn_error,
            kl,
            teacher_top1: 1.0 - kl,
            ..EvalRow::default()
        };
        let rows = vec![
            row(2048, "wave", 1.0, 300.0, 0.1, 0.02),
            row(2048, "wave", 2.0, 600.0, 0.05, 0.01),
            row(2048, "topk", 1.0, 300.0, 0.08, 0.015),
            row(4096, "wave", 1.0, 400.0, 0.12, 0.03),
        ];
        let passkeys = vec![PasskeyRow {
            length: 2048,
            method: "wave",
            codec: "f16".into(),
            budget_scale: 1.0,
            correct: 2,
            trials: 3,
            ..PasskeyRow::default()
        }];
        let charts = eval_charts(&rows, &passkeys);
        let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["eval_frontier_2048", "eval_frontier_4096", "eval_kl", "eval_top1", "eval_passkey"]);
        let frontier = &charts[0].1;
        let oracle = frontier.series.iter().find(|s| s.reference).unwrap();
        assert_eq!((oracle.name.as_str(), oracle.points.as_slice()), ("topk/f16 (oracle)", &[(300.0, 0.08)][..]));
        let wave = frontier.series.iter().find(|s| s.name == "wave/f16").unwrap();
        assert_eq!(wave.points, [(300.0, 0.1), (600.0, 0.05)]);
        let kl = charts[2].1.series.iter().find(|s| s.name == "wave/f16 1x").unwrap();
        assert_eq!(kl.points, [(2048.0, 0.02), (4096.0, 0.03)]);
        assert_eq!(charts[4].1.series[0].points, [(2048.0, 2.0 / 3.0)]);
    }
}
