//! Prefill with the wave index's clustering on the GPU (feature `cuda`): the layer's KV is
//! copied to the device as f16, `GpuBackend::build_layout_seeded` clusters every (KV head,
//! segment) there from the rows the index's own build would start from, and only the
//! clustering (each row's token, each cluster's offset) comes back; the index is then
//! restored from it as from a checkpointed layout, with no k-means on the CPU.

use attnstore_index::{HeadLayout, IndexLayout, SegmentLayout, WaveLayout};
use attnstore_kernels::layout::LayoutParams;

use crate::context::ContextId;
use crate::engine::{layer_of, Engine};
use crate::error::Result;
use crate::spec::{LayerKind, Method};

impl Engine {
    /// [`Engine::prefill`] with the clustering on the GPU. It applies to the first ingest of
    /// a global layer of a wave context (plain f32 / f16 / bf16 rows, or `hack2` rows, which
    /// the index encodes from the GPU's cluster order as it would from its own) whose
    /// prefill makes at least one segment; any other prefill, and a machine without a usable GPU,
    /// runs [`Engine::prefill`] itself (the CPU), and the result says which ran: `true` when
    /// the GPU clustered. Bad input is rejected as `prefill` rejects it.
    ///
    /// The device starts each segment's k-means from the rows the CPU build would and runs
    /// the same algorithm in f16 on the tensor cores, so layouts match the CPU's except where
    /// rounding flips a near tie or a cluster empties (the CPU re-seeds it, the device keeps
    /// it). A durable engine logs the KV as a plain prefill: recovery before the next
    /// checkpoint clusters it again on the CPU.
    pub fn prefill_gpu(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<bool> {
        let start = std::time::Instant::now();
        match self.device_layout(id, layer, keys, values)? {
            Some(layout) => {
                crate::metrics::ingest_phase("prefill", "device_layout", start.elapsed());
                let layout = IndexLayout::Wave(layout);
                let batch = crate::catalog::Batch { keys, values, prefill: true, layout: Some(&layout) };
                self.ingest_with(id, layer, batch, true)?;
                Ok(true)
            }
            None => self.prefill(id, layer, keys, values).map(|()| false),
        }
    }

    /// The wave layout the GPU computes for a prefill of `keys`, or `None` where the GPU does
    /// not apply (then the caller prefills on the CPU, which also reports bad input). Values
    /// are not checked here: NaN or infinite input clusters arbitrarily (no out-of-bounds
    /// index can come of it) and `ingest_with` rejects it before the layout is used.
    fn device_layout(&self, id: ContextId, layer: usize, keys: &[f32], values: &[f32]) -> Result<Option<WaveLayout>> {
        let ctx = self.context(id)?;
        let (h, d) = (ctx.spec.shape.kv_heads, ctx.spec.shape.head_dim);
        let Method::Wave(params) = ctx.spec.method else { return Ok(None) };
        if keys.is_empty() || !keys.len().is_multiple_of(h * d) || values.len() != keys.len() {
            return Ok(None);
        }
        {
            let guard = layer_of(&ctx, id, layer)?.read();
            if guard.prefilled || guard.kind != LayerKind::Global {
                return Ok(None);
            }
        }
        let tokens = keys.len() / (h * d);
        let (sink, segments) = params.prefill_segments(tokens);
        let Some(&(last_first, last_len)) = segments.last() else { return Ok(None) };
        let clustered_end = last_first + last_len;
        // No usable GPU: the CPU prefills (the error is not the caller's input).
        let Ok(gpu) = self.gpu.backend(d) else { return Ok(None) };
        let lp = LayoutParams {
            segment_tokens: params.segment_tokens,
            tokens_per_cluster: params.tokens_per_cluster,
            sink_tokens: sink,
            local_tokens: tokens - clustered_end,
            max_iters: params.max_iters,
            seed: params.seed,
        };
        let kv = gpu.upload_f32(keys, values, h)?;
        let built = gpu.build_layout_seeded(&kv, lp, &|head, s| params.segment_seed(s, head))?;
        let (positions, offsets) = built.download_order(&gpu)?;
        let k = built.clusters;
        let segments = built
            .segments()
            .into_iter()
            .zip(&segments)
            .map(|((first_row, len, clusters), &(first, expected))| {
                debug_assert_eq!((first_row + sink, len), (first, expected), "device and index cut alike");
                let heads = (0..h)
                    .map(|head| {
                        let off = &offsets[head * (k + 1)..(head + 1) * (k + 1)];
                        let rows = off[clusters.start] as usize..off[clusters.end] as usize;
                        HeadLayout {
                            // The index keeps non-empty clusters only.
                            sizes: clusters.clone().map(|c| off[c + 1] - off[c]).filter(|&n| n > 0).collect(),
                            positions: positions[head * tokens + rows.start..head * tokens + rows.end].to_vec(),
                        }
                    })
                    .collect();
                SegmentLayout { first: first as u64, len: len as u64, heads }
            })
            .collect();
        Ok(Some(WaveLayout {
            tokens: tokens as u64,
            sink_len: sink as u64,
            tail_start: clustered_end as u64,
            segments,
        }))
    }
}
