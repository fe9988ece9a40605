//! Real KV traces: capture a model's post-RoPE keys, values and decode queries into a
//! directory (format in `docs/trace-format.md`), load them back with every size and checksum
//! verified, and evaluate attnstore's methods on them against exact attention.

use crate::error::{Error, Result};
use crate::model::{argmax, AttentionBackend, Model};
use crate::session::{relative_l2, store_context, AttnConfig, AttnMethod, Session};
use attnstore::{Budget, Codec, ContextSpec, Engine, EngineConfig, LayerCodecs, LayerKind, Method, Request};
use half::f16;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Name of the trace's description file.
pub const TRACE_JSON: &str = "trace.json";
/// Value of `format` in `trace.json`.
pub const TRACE_FORMAT: &str = "attnstore-trace";
/// The format version this build writes and reads.
pub const TRACE_VERSION: u32 = 1;

/// Size and CRC-32C of one data file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileEntry {
    /// Bytes.
    pub bytes: u64,
    /// CRC-32C (Castagnoli) of the whole file.
    pub crc32c: u32,
}

/// `trace.json`: what the trace holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TraceMeta {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// Format version ([`TRACE_VERSION`]).
    pub version: u32,
    /// The model's name.
    pub model: String,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Prompt tokens (prefilled with exact attention).
    pub prompt_tokens: usize,
    /// Decode steps captured: step `s` feeds the token at position `prompt_tokens + s`.
    pub decode_steps: usize,
    /// All token ids, prompt then decoded (`prompt_tokens + decode_steps`).
    pub tokens: Vec<u32>,
    /// Every data file with its size and checksum.
    pub files: BTreeMap<String, FileEntry>,
}

impl TraceMeta {
    /// Tokens whose KV the trace holds.
    pub fn total_tokens(&self) -> usize {
        self.prompt_tokens + self.decode_steps
    }

    fn shape(&self) -> Result<attnstore::AttnShape> {
        attnstore::AttnShape::new(self.q_heads, self.kv_heads, self.head_dim)
            .map_err(|e| Error::BadTrace { path: TRACE_JSON.into(), detail: e.to_string() })
    }
}

/// A loaded trace: per layer all tokens' keys and values (`kv_heads × tokens × head_dim`)
/// and the decode queries (`steps × layers × q_heads × head_dim`), as f32.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The description.
    pub meta: TraceMeta,
    /// Per layer, `(keys, values)`.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// Decode queries.
    pub queries: Vec<f32>,
}

fn kv_file(layer: usize) -> String {
    format!("kv-{layer:03}.bin")
}

const QUERIES: &str = "queries.bin";

/// Records each decode step's q/k/v while an exact session serves attention.
struct Recorder<'a, 'b> {
    session: &'b mut Session<'a>,
    /// Per layer, the keys and values of decoded tokens, token-major (`tokens × kv × d`).
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    queries: Vec<f32>,
}

impl AttentionBackend for Recorder<'_, '_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>> {
        self.queries.extend_from_slice(q);
        self.kv[layer].0.extend_from_slice(k);
        self.kv[layer].1.extend_from_slice(v);
        self.session.attend(layer, q, k, v)
    }
}

/// Runs `prompt` through `model` (exact attention, prefill in `chunk`-token pieces), decodes
/// `steps` tokens greedily and writes the trace to `out` (created; existing trace files are
/// overwritten).
pub fn capture(
    model: &Model,
    prompt: &[u32],
    chunk: usize,
    steps: usize,
    out: &Path,
    progress: &mut dyn FnMut(usize),
) -> Result<TraceMeta> {
    if steps == 0 {
        return Err(Error::InvalidInput("a trace needs at least one decode step (its queries)".into()));
    }
    let c = *model.config();
    if c.sliding_window.is_some() {
        return Err(Error::InvalidInput(format!(
            "traces hold every layer's whole KV; {} has sliding-window layers (record a model whose layers are all global)",
            c.arch
        )));
    }
    let prefill = model.prefill(prompt, chunk, progress)?;
    let engine = Engine::in_memory(EngineConfig::default())?;
    let config = AttnConfig { codec: Codec::F32.into(), ..AttnConfig::new(AttnMethod::Exact) };
    let mut session = Session::new(model, &engine, config, &prefill, false)?;
    let mut rec = Recorder { session: &mut session, kv: vec![(Vec::new(), Vec::new()); c.layers], queries: Vec::new() };
    let mut tokens = prompt.to_vec();
    let mut next = argmax(&prefill.logits);
    for s in 0..steps {
        tokens.push(next);
        next = argmax(&model.decode_step(next, prompt.len() + s, &mut rec)?);
    }
    std::fs::create_dir_all(out).map_err(Error::io(out))?;
    let mut files = BTreeMap::new();
    let (p, d, h) = (prompt.len(), c.head_dim, c.kv_heads);
    for (l, ((pk, pv), (dk, dv))) in prefill.kv.iter().zip(&rec.kv).enumerate() {
        // Prompt KV is head-major already; decoded tokens were recorded token-major.
        let mut bytes = Vec::with_capacity(2 * h * (p + steps) * d * 2);
        for (prompt_part, decoded) in [(pk, dk), (pv, dv)] {
            for head in 0..h {
                let rows = prompt_part[head * p * d..(head + 1) * p * d]
                    .iter()
                    .chain((0..steps).flat_map(|s| &decoded[(s * h + head) * d..(s * h + head + 1) * d]));
                bytes.extend(rows.flat_map(|&x| f16::from_f32(x).to_le_bytes()));
            }
        }
        files.insert(kv_file(l), write_file(&out.join(kv_file(l)), &bytes)?);
    }
    let qbytes: Vec<u8> = rec.queries.iter().flat_map(|x| x.to_le_bytes()).collect();
    files.insert(QUERIES.into(), write_file(&out.join(QUERIES), &qbytes)?);
    let meta = TraceMeta {
        format: TRACE_FORMAT.into(),
        version: TRACE_VERSION,
        model: "SmolLM2-135M-Instruct.Q4_1".into(),
        layers: c.layers,
        q_heads: c.q_heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        prompt_tokens: p,
        decode_steps: steps,
        tokens,
        files,
    };
    let json = serde_json::to_vec_pretty(&meta).expect("trace meta serializes");
    // The description is written last: a directory without it is not a trace.
    write_file(&out.join(TRACE_JSON), &json)?;
    Ok(meta)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<FileEntry> {
    std::fs::write(path, bytes).map_err(Error::io(path))?;
    Ok(FileEntry { bytes: bytes.len() as u64, crc32c: crc32c::crc32c(bytes) })
}

fn bad(path: &Path, detail: impl Into<String>) -> Error {
    Error::BadTrace { path: path.to_path_buf(), detail: detail.into() }
}

impl Trace {
    /// Loads a trace directory, checking the format, every file's size and checksum, and
    /// that the sizes match the shape.
    pub fn load(dir: &Path) -> Result<Self> {
        let json_path = dir.join(TRACE_JSON);
        let text = std::fs::read(&json_path).map_err(Error::io(&json_path))?;
        let meta: TraceMeta =
            serde_json::from_slice(&text).map_err(|e| bad(&json_path, format!("not a trace description: {e}")))?;
        if meta.format != TRACE_FORMAT || meta.version != TRACE_VERSION {
            return Err(bad(
                &json_path,
                format!(
                    "format {:?} version {}, expected {TRACE_FORMAT:?} version {TRACE_VERSION}",
                    meta.format, meta.version
                ),
            ));
        }
        let shape = meta.shape()?;
        if meta.layers == 0 || meta.prompt_tokens == 0 || meta.decode_steps == 0 {
            return Err(bad(&json_path, "layers, prompt_tokens and decode_steps must all be positive"));
        }
        if meta.tokens.len() != meta.total_tokens() {
            return Err(bad(
                &json_path,
                format!("{} token ids, expected prompt + decode = {}", meta.tokens.len(), meta.total_tokens()),
            ));
        }
        let read = |name: &str, expected: usize| -> Result<Vec<u8>> {
            let path = dir.join(name);
            let entry = meta.files.get(name).ok_or_else(|| bad(&json_path, format!("no entry for {name}")))?;
            let bytes = std::fs::read(&path).map_err(Error::io(&path))?;
            if bytes.len() as u64 != entry.bytes || bytes.len() != expected {
                return Err(bad(
                    &path,
                    format!("{} bytes; trace.json says {}, the shape needs {expected}", bytes.len(), entry.bytes),
                ));
            }
            let crc = crc32c::crc32c(&bytes);
            if crc != entry.crc32c {
                return Err(bad(
                    &path,
                    format!("checksum {crc:#010x}, expected {:#010x}: the file is corrupt", entry.crc32c),
                ));
            }
            Ok(bytes)
        };
        let n = shape.kv_len(meta.total_tokens());
        let kv = (0..meta.layers)
            .map(|l| {
                let bytes = read(&kv_file(l), 2 * n * 2)?;
                let vals: Vec<f32> = bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
                let (k, v) = vals.split_at(n);
                Ok((k.to_vec(), v.to_vec()))
            })
            .collect::<Result<Vec<_>>>()?;
        let qn = meta.decode_steps * meta.layers * shape.query_len();
        let queries = read(QUERIES, qn * 4)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect::<Vec<f32>>();
        if let Some(i) = attnstore_kernels::first_non_finite(&queries) {
            return Err(bad(&dir.join(QUERIES), format!("value {i} is not finite")));
        }
        Ok(Self { meta, kv, queries })
    }

    /// Keys and values of tokens `range` of `layer`, in the engine's layout.
    pub fn layer_kv(&self, layer: usize, range: std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let (t, d) = (self.meta.total_tokens(), self.meta.head_dim);
        let pick = |x: &[f32]| -> Vec<f32> {
            (0..self.meta.kv_heads)
                .flat_map(|h| x[(h * t + range.start) * d..(h * t + range.end) * d].to_vec())
                .collect()
        };
        (pick(&self.kv[layer].0), pick(&self.kv[layer].1))
    }

    /// The query of decode step `step` at `layer` (`q_heads × head_dim`).
    pub fn query(&self, step: usize, layer: usize) -> &[f32] {
        let n = self.meta.q_heads * self.meta.head_dim;
        let at = (step * self.meta.layers + layer) * n;
        &self.queries[at..at + n]
    }
}

/// One method's results on a trace.
#[derive(Debug, Clone, Serialize)]
pub struct TraceRow {
    /// Method name.
    pub method: &'static str,
    /// Codec of the stored rows.
    pub codec: String,
    /// Budget scale relative to the default.
    pub budget_scale: f64,
    /// The estimation share (`rest` or a fraction).
    pub estimate: String,
    /// Cluster choice per KV head or per query head.
    pub selection: &'static str,
    /// Layers attended exactly whatever the budget.
    pub dense_layers: usize,
    /// Mean relative L2 error of the attention output vs exact, over steps and layers.
    pub rel_error: f64,
    /// Per layer, the mean relative error over steps.
    pub layer_error: Vec<f64>,
    /// Mean recall of the true top-n (n = the tokens a head attended exactly).
    pub recall: f64,
    /// Mean tokens attended exactly per query head.
    pub exact_tokens: f64,
    /// Mean share of the context attended exactly.
    pub exact_share: f64,
    /// Bytes read by the plans over bytes read by exact attention.
    pub bytes_ratio: f64,
    /// Layer plans the planner made exact.
    pub exact_plans: usize,
    /// Layer plans in total.
    pub plans: usize,
}

/// Replays a trace through `configs`: every layer's prompt KV is prefilled, and each decode
/// step appends its token and runs one request per layer, compared with exact attention over
/// the same KV.
pub fn bench_trace(
    trace: &Trace,
    configs: &[(AttnConfig, f64)],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<TraceRow>> {
    let m = &trace.meta;
    let shape = m.shape()?;
    let (p, d, g) = (m.prompt_tokens, m.head_dim, shape.group());
    let mut rows = Vec::new();
    for &(config, scale) in configs {
        progress(&format!("{} x{scale}", config.method.name()));
        let engine = Engine::in_memory(EngineConfig::default())?;
        let make = |spec: ContextSpec| store_context(&engine, spec, (0..m.layers).map(|l| trace.layer_kv(l, 0..p)));
        let (ctx, exact) = (
            make(config.spec(shape, &vec![LayerKind::Global; m.layers]))?,
            make(ContextSpec::new(shape, m.layers).with_method(Method::Flat))?,
        );
        let mut row = TraceRow {
            method: config.method.name(),
            codec: config.codec.to_string(),
            budget_scale: scale,
            estimate: match config.budget.estimate {
                attnstore::EstimateShare::Rest => "rest".into(),
                attnstore::EstimateShare::Fraction(f) => format!("{f}"),
            },
            selection: config.budget.mode.name(),
            dense_layers: config.dense_layers,
            rel_error: 0.0,
            layer_error: vec![0.0; m.layers],
            recall: 0.0,
            exact_tokens: 0.0,
            exact_share: 0.0,
            bytes_ratio: 0.0,
            exact_plans: 0,
            plans: 0,
        };
        let (mut bytes, mut exact_bytes, mut recall_n) = (0.0, 0.0, 0usize);
        for s in 0..m.decode_steps {
            let t = p + s + 1;
            for l in 0..m.layers {
                let (k, v) = trace.layer_kv(l, p + s..p + s + 1);
                engine.append(ctx, l, &k, &v)?;
                engine.append(exact, l, &k, &v)?;
                let q = trace.query(s, l).to_vec();
                let plan = engine.plan(&[Request::new(ctx, l, q.clone())], &config.layer_budget(l))?;
                let got = engine.execute(&plan)?.pop().expect("one output");
                let want = engine
                    .execute(&engine.plan(&[Request::new(exact, l, q.clone())], &Budget::full())?)?
                    .pop()
                    .expect("one output");
                let err = relative_l2(&got, &want);
                row.rel_error += err;
                row.layer_error[l] += err;
                let r = &plan.requests[0];
                row.plans += 1;
                row.exact_plans += usize::from(matches!(r.strategy, attnstore::Strategy::Exact { .. }));
                bytes += r.cost.total_bytes() as f64;
                exact_bytes += r.cost.exact_bytes as f64;
                // All tokens' keys of this layer, head-major with the whole trace as stride.
                let keys = &trace.kv[l].0;
                let total = m.total_tokens();
                for qh in 0..shape.q_heads {
                    let positions = engine.exact_positions(&plan, 0, qh)?;
                    row.exact_tokens += positions.len() as f64;
                    row.exact_share += positions.len() as f64 / t as f64;
                    if positions.len() < t {
                        let kv_head = qh / g;
                        let qv = &q[qh * d..(qh + 1) * d];
                        let scores: Vec<f32> = (0..t)
                            .map(|j| qv.iter().zip(&keys[(kv_head * total + j) * d..]).map(|(a, b)| a * b).sum())
                            .collect();
                        row.recall += recall_of(&positions, &scores);
                        recall_n += 1;
                    }
                }
            }
        }
        let n = (m.decode_steps * m.layers) as f64;
        row.rel_error /= n;
        row.layer_error.iter_mut().for_each(|e| *e /= m.decode_steps as f64);
        row.exact_tokens /= n * shape.q_heads as f64;
        row.exact_share /= n * shape.q_heads as f64;
        row.recall = if recall_n == 0 { 1.0 } else { row.recall / recall_n as f64 };
        row.bytes_ratio = bytes / exact_bytes.max(1.0);
        rows.push(row);
    }
    Ok(rows)
}

/// Fraction of the true top-`n` (by `scores`) found among `positions` (`n = positions.len()`).
pub fn recall_of(positions: &[u32], scores: &[f32]) -> f64 {
    let n = positions.len();
    if n == 0 {
        return 1.0;
    }
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    order.select_nth_unstable_by(n - 1, |&a, &b| scores[b as usize].total_cmp(&scores[a as usize]));
    let mut top = vec![false; scores.len()];
    order[..n].iter().for_each(|&i| top[i as usize] = true);
    positions.iter().filter(|&&p| top[p as usize]).count() as f64 / n as f64
}

/// The default set of trace evaluations: exact, then wave, pq and the oracle top-k at
/// 0.5×, 1× and 2× the default budget.
pub fn default_configs() -> Vec<(AttnConfig, f64)> {
    configs_for(&[crate::session::default_budget()], 0, Codec::F16.into())
}

/// Exact, then for every base budget wave, pq and the oracle top-k at 0.5×, 1× and 2× it,
/// with `dense_layers` exact layers.
pub fn configs_for(bases: &[Budget], dense_layers: usize, codec: LayerCodecs) -> Vec<(AttnConfig, f64)> {
    let mut out = vec![(AttnConfig { codec, ..AttnConfig::new(AttnMethod::Exact) }, 1.0)];
    for &budget in bases {
        for method in [AttnMethod::Wave, AttnMethod::Pq, AttnMethod::TopK] {
            for scale in [0.5, 1.0, 2.0] {
                out.push((AttnConfig { budget, dense_layers, codec, ..AttnConfig::new(method) }.scaled(scale), scale));
            }
        }
    }
    out
}
