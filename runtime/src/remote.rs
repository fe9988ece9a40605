//! Prompts shared between runtimes through the engine's remote tier: a session starts from
//! the longest published prefix of its prompt (attached, not computed), prefills only the
//! rest, and publishes its whole prompt in the background for the next runtime.

use crate::error::{Error, Result};
use crate::model::{Model, Prefill};
use crate::session::{AttnConfig, Session};
use attnstore::remote::{ModelId, RemoteTier};
use attnstore::Engine;
use std::time::{Duration, Instant};

/// A session started through the remote tier.
pub struct RemoteStart<'a> {
    /// The session, positioned after the prompt.
    pub session: Session<'a>,
    /// Next-token logits after the prompt's last token.
    pub logits: Vec<f32>,
    /// Prompt tokens attached from the remote tier.
    pub reused_tokens: usize,
    /// Prompt tokens run through the model.
    pub prefilled_tokens: usize,
    /// Time to find and attach the prefix.
    pub attach_time: Duration,
    /// Time to prefill the rest and store it.
    pub prefill_time: Duration,
}

/// Starts a session over `tokens` in `engine`: attaches the longest prefix of all but the
/// last prompt token published under `id` (the last token is always run, for its logits),
/// prefills the rest `chunk` tokens at a time on top of it, and queues the whole prompt's
/// KV for publishing. `progress` counts prefilled tokens. Remote failures only shorten
/// the reused prefix (the tier counts them); with nothing published this is a plain
/// prefill plus a publish.
#[allow(clippy::too_many_arguments)]
pub fn start<'a>(
    model: &'a Model,
    engine: &'a Engine,
    config: AttnConfig,
    tier: &RemoteTier,
    id: &ModelId,
    tokens: &[u32],
    chunk: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<RemoteStart<'a>> {
    if tokens.is_empty() {
        return Err(Error::InvalidInput("the prompt is empty: at least one token is needed".into()));
    }
    config.budget.validate()?;
    let c = model.config();
    let kinds = c.layer_kinds();
    let spec = config.spec(c.attn_shape(), &kinds);
    let started = Instant::now();
    let attached = tier.attach(engine, spec.clone(), id, &tokens[..tokens.len() - 1])?;
    let attach_time = started.elapsed();
    let started = Instant::now();
    let (ctx, reused, p) = match attached {
        Some(a) => {
            let p = model.prefill_after(&a.kv, a.tokens, &tokens[a.tokens..], chunk, true, progress)?;
            append_rest(engine, a.context, &p, a.tokens, tokens.len())?;
            (a.context, a.tokens, p)
        }
        None => {
            let p = model.prefill_after(&[], 0, tokens, chunk, true, progress)?;
            let ctx =
                crate::session::store_context(engine, spec, p.kv.iter().map(|(k, v)| (k.as_slice(), v.as_slice())))?;
            (ctx, 0, p)
        }
    };
    for l in 0..kinds.len() {
        engine.wait_index(ctx, l, Duration::from_secs(600))?;
    }
    let prefill_time = started.elapsed();
    let Prefill { kv, logits, .. } = p;
    tier.publish(engine, ctx, id, tokens, kv)?;
    Ok(RemoteStart {
        session: Session::resume(model, engine, config, ctx, tokens.len()),
        logits,
        reused_tokens: reused,
        prefilled_tokens: tokens.len() - reused,
        attach_time,
        prefill_time,
    })
}

/// Appends the KV of tokens `from..to` from `p` (which holds each layer's last rows up to
/// token `to`) to each layer of `ctx`.
fn append_rest(engine: &Engine, ctx: attnstore::ContextId, p: &Prefill, from: usize, to: usize) -> Result<()> {
    let shape = engine.spec(ctx)?.shape;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    for (l, (k, v)) in p.kv.iter().enumerate() {
        let rows = k.len() / (h * d);
        // The stored rows are positions `to - rows..to`; append those at `from..` of them.
        let first = from.max(to - rows);
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for head in 0..h {
            let r = (head * rows + first - (to - rows)) * d..(head + 1) * rows * d;
            ks.extend_from_slice(&k[r.clone()]);
            vs.extend_from_slice(&v[r]);
        }
        engine.append(ctx, l, &ks, &vs)?;
    }
    Ok(())
}
