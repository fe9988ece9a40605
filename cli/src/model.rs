//! The real-model commands: `generate`, `capture`, `eval`, `argmax`, and `bench --trace`.

use attnstore::{Budget, Codec, EstimateShare};
use attnstore_runtime::eval::{self, EvalConfig, EvalRow, PasskeyRow};
use attnstore_runtime::trace::{self, Trace, TraceRow};
use attnstore_runtime::{argmax, default_model_path, AttnConfig, AttnMethod, Model, Session, Tokenizer, Weights};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

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
    /// Prefill chunk (tokens).
    #[arg(long, default_value_t = 256)]
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
    /// Codec of the stored KV: f16 (default), or hack2 / hack2:Π (2-bit homomorphic rows;
    /// with `exact`, exact attention over the 2-bit rows).
    #[arg(long, default_value = "f16")]
    codec: Codec,
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
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
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
    /// Methods compared with exact: wave, pq, topk.
    #[arg(long, default_value = "wave,pq,topk", value_delimiter = ',', value_parser = parse_method)]
    methods: Vec<AttnMethod>,
    /// Budget scales relative to the default budget.
    #[arg(long, default_value = "0.5,1,2", value_delimiter = ',')]
    scales: Vec<f64>,
    /// Tokens of the exact continuation (teacher-forced and free-running agreement).
    #[arg(long, default_value_t = 64)]
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
    /// Needle depths.
    #[arg(long, default_value = "0.1,0.5,0.9", value_delimiter = ',')]
    passkey_depths: Vec<f64>,
    /// Seed of the pass keys.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Also write the JSON lines to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
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
    /// The JSON file to write.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
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

fn load(args: &ModelArgs, default: Weights) -> Result<Model, String> {
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let start = Instant::now();
    let weights = args.weights.unwrap_or(default);
    let model = Model::load(&path, weights).map_err(|e| e.to_string())?;
    eprintln!("loaded {} ({weights:?} weights) in {:.1} s", path.display(), start.elapsed().as_secs_f64());
    Ok(model)
}

fn prompt_ids(model: &Model, file: &std::path::Path, raw: bool) -> Result<Vec<u32>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let text = if raw { text } else { Tokenizer::chat_prompt(text.trim()) };
    model.tokenizer().encode(&text).map_err(|e| e.to_string())
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
    let pb = bar(ids.len(), "prefill");
    let start = Instant::now();
    let p = model.prefill(ids, chunk, &mut |n| pb.set_position(n as u64)).map_err(|e| e.to_string())?;
    pb.finish_and_clear();
    let s = start.elapsed().as_secs_f64();
    eprintln!("prefill: {} tokens in {s:.1} s ({:.0} tokens/s)", ids.len(), ids.len() as f64 / s);
    Ok(p)
}

/// `attnstore generate`.
pub fn generate(args: GenerateArgs) -> Result<(), String> {
    let model = load(&args.model, Weights::Quantized)?;
    let ids = prompt_ids(&model, &args.prompt_file, args.raw)?;
    let p = prefill(&model, &ids, args.model.chunk)?;
    let engine = attnstore::Engine::in_memory(attnstore::EngineConfig::default()).map_err(|e| e.to_string())?;
    let config = AttnConfig { budget: args.budget.budget()?, codec: args.budget.codec, ..AttnConfig::new(args.method) };
    let mut session = Session::new(&model, &engine, config, &p, false).map_err(|e| e.to_string())?;
    let tok = model.tokenizer();
    let start = Instant::now();
    let mut next = argmax(&p.logits);
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
    Ok(())
}

/// `attnstore capture`.
pub fn capture(args: CaptureArgs) -> Result<(), String> {
    let model = load(&args.model, Weights::Quantized)?;
    let ids = prompt_ids(&model, &args.prompt_file, args.raw)?;
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
    let mut configs = trace::configs_for(bases, dense_layers, Codec::F16);
    if codec != Codec::F16 {
        configs.extend(trace::configs_for(bases, dense_layers, codec));
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
    let model = load(&args.model, Weights::Dequantized)?;
    let base = args.budget.budget()?;
    let mut variants = Vec::new();
    let codec = args.budget.codec;
    for &m in &args.methods {
        // Exact attention is the reference; over a 2-bit codec it is a variant of its own.
        if m == AttnMethod::Exact && codec.hack().is_none() {
            continue;
        }
        for &s in &args.scales {
            if !(s.is_finite() && s > 0.0) {
                return Err(format!("budget scale {s} must be positive"));
            }
            variants.push((AttnConfig { budget: base, codec, ..AttnConfig::new(m) }.scaled(s), s));
        }
    }
    let config = EvalConfig {
        lengths: args.lengths,
        variants,
        gen_tokens: args.gen_tokens.max(2),
        passkey_lengths: if args.skip_passkey { Vec::new() } else { args.passkey_lengths },
        passkey_depths: args.passkey_depths,
        seed: args.seed,
        chunk: args.model.chunk,
        summary_text: match &args.summary_text {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let name = path.file_stem().map_or_else(|| "text".into(), |s| s.to_string_lossy().into_owned());
                Some((name, text))
            }
            None => None,
        },
    };
    let json_file = match &args.json_out {
        Some(p) => Some(std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
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
    Ok(())
}

fn eval_table(rows: &[EvalRow]) -> String {
    let mut s = format!(
        "{:>6} {:<12} {:>6} {:>7} {:>15} {:>7} {:>7} {:>6} {:>9} {:>8} {:>7} {:>6}\n",
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
        "exact%"
    );
    for r in rows {
        s += &format!(
            "{:>6} {:<12} {:>5}x {:>6.1}% {:>9.1}% ({:>2}) {:>7.4} {:>6.1}% {:>6} {:>9.4} {:>8.0} {:>6.1}% {:>5.0}%\n",
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
            100.0 * r.exact_plan_share
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
    let model = load(&args.model, Weights::Quantized)?;
    let ids = prompt_ids(&model, &args.prompt_file, false)?;
    let p = prefill(&model, &ids, args.model.chunk)?;
    let engine = attnstore::Engine::in_memory(attnstore::EngineConfig::default()).map_err(|e| e.to_string())?;
    let mut s =
        Session::new(&model, &engine, AttnConfig::new(AttnMethod::Exact), &p, false).map_err(|e| e.to_string())?;
    let cont = s.greedy(argmax(&p.logits), args.max_tokens, None).map_err(|e| e.to_string())?;
    // Each continuation token was the argmax after the tokens before it.
    let mut tokens = ids.clone();
    tokens.extend(&cont);
    let value = serde_json::json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "weights": format!("{:?}", model.weights()),
        "tokens": tokens,
        "prompt_tokens": ids.len(),
        "argmax_from": ids.len() - 1,
        "argmax": cont,
        "prompt_text": Tokenizer::chat_prompt(std::fs::read_to_string(&args.prompt_file).unwrap_or_default().trim()),
    });
    std::fs::write(&args.out, serde_json::to_vec(&value).expect("serializes"))
        .map_err(|e| format!("{}: {e}", args.out.display()))?;
    println!("wrote {} ({} prompt tokens, {} teacher-forced positions)", args.out.display(), ids.len(), cont.len());
    Ok(())
}
