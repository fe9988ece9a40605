//! Times planning and execution of one wave request on a synthetic context, in a loop long
//! enough to profile (`perf record -D <ms after the build> ...`).
//!
//! Environment: `TOKENS` (default 131072), `ITERS` per round (default 200, three rounds),
//! `EST` (an estimate share as a fraction; default `rest`), `COLD=1` (read 512 MiB between
//! steps, as `attnstore bench` does by interleaving exact attention), `CODEC` (`f16`
//! default, or `hack2`), `EXACT=1` (plan with `Budget::full()`: every row).
//! Run: `cargo run --release -p attnstore-bench --example profile_wave`.
use attnstore::{
    AttnShape, Budget, Codec, ContextSpec, Engine, EngineConfig, EstimateShare, Method, Request, WaveParams,
};
use attnstore_bench::{SynthContext, SynthParams};
use std::time::Instant;

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let tokens = env("TOKENS").unwrap_or(131_072);
    let iters = env::<usize>("ITERS").unwrap_or(200).max(1);
    let shape = AttnShape::new(32, 8, 128)?;
    let synth = SynthContext::generate(SynthParams::new(shape, tokens, 42));
    let engine = Engine::in_memory(EngineConfig::default())?;
    let codec: Codec = std::env::var("CODEC").unwrap_or_else(|_| "f16".into()).parse()?;
    let spec = ContextSpec::new(shape, 1).with_codec(codec).with_method(Method::Wave(WaveParams::default()));
    let ctx = engine.create_context(spec)?;
    engine.prefill(ctx, 0, &synth.keys, &synth.values)?;
    let share = env("EST").map_or(EstimateShare::Rest, EstimateShare::Fraction);
    let budget = if env::<u8>("EXACT").is_some() { Budget::full() } else { Budget::default().with_estimate(share) };
    let flush: Vec<u64> = if env::<u8>("COLD").is_some() { (0..64u64 << 20).collect() } else { Vec::new() };
    if env::<u8>("EXPLAIN").is_some() {
        println!("{}", engine.plan(&[Request::new(ctx, 0, synth.queries(0))], &budget)?.explain());
    }
    for round in 0..3 {
        let (mut plans, mut execs) = (Vec::new(), Vec::new());
        for i in 0..iters {
            std::hint::black_box(flush.iter().fold(0u64, |a, x| a.wrapping_add(*x)));
            let req = [Request::new(ctx, 0, synth.queries(i as u64 % 4))];
            let t = Instant::now();
            let plan = engine.plan(&req, &budget)?;
            let planned = t.elapsed().as_secs_f64() * 1e6;
            std::hint::black_box(engine.execute(&plan)?);
            plans.push(planned);
            execs.push(t.elapsed().as_secs_f64() * 1e6 - planned);
        }
        println!("round {round}: plan median {:.1} us, execute median {:.1} us", median(plans), median(execs));
    }
    Ok(())
}
