//! `attnstore inspect`'s run: one synthetic context served from the index and from the
//! buffer manager gives the same answers, with timing rows for each store.

use attnstore::{AttnShape, BlockLayout, Budget, BufferSettings, Codec, HackParams, Tier};
use attnstore_bench::InspectConfig;

#[test]
fn inspect_serves_one_context_from_both_stores_with_the_same_answers() {
    for codec in [Codec::F16, Codec::Hack2(HackParams::default())] {
        let cfg = InspectConfig {
            tokens: 3000,
            shape: AttnShape::new(8, 2, 32).unwrap(),
            codec,
            steps: 4,
            exact_steps: 2,
            budget: Budget::default().with_retrieve_floor(0).with_retrieve(0.05),
            // No maintainer thread: results do not depend on timing. `host_blocks == 0`:
            // the run sizes the arena to hold the whole context.
            buffers: BufferSettings { maintainer_idle: None, ..BufferSettings::new(0) },
            block: BlockLayout::default(),
            seed: 21,
            progress: false,
        };
        let report = attnstore_bench::inspect::run(&cfg).unwrap();
        assert!(report.max_rel_diff <= 1e-6, "{codec}: {}", report.max_rel_diff);
        if codec.hack().is_none() {
            // 2-bit rows are homed per value block: their plans record no cluster blocks.
            assert!(report.explain.contains("(looked up)"), "{}", report.explain);
        }
        assert!(report.stats.tier(Tier::Host).unwrap().used_blocks > 0, "{codec}: {}", report.stats);
        // Sparse, exact and prefill rows for each of the two stores.
        assert_eq!(report.rows.len(), 6);
        let steps = |what: &str| {
            report
                .rows
                .iter()
                .filter(|r| r.get("what").and_then(|v| v.as_str()) == Some(what))
                .map(|r| r.get("steps").and_then(|v| v.as_u64()).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!((steps("sparse decode"), steps("exact decode")), (vec![4, 4], vec![2, 2]));
    }
}
