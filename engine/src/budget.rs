//! Budgets: how much of a context a plan attends exactly and how much it estimates.
//! Fractions are of the context's tokens, with a floor in tokens so that short contexts
//! keep enough exact attention (on SmolLM2 at 4K tokens a floor of ~512 exact tokens was
//! what brought KL divergence to ≤ 0.015; 1.8% alone was visibly wrong).

use crate::error::{Error, Result};
use attnstore_index::{SelectionMode, ZoneBudget};

/// How much of the non-retrieved clusters the estimation zone covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EstimateShare {
    /// This fraction of the context's tokens (RetroInfer: 0.232).
    Fraction(f64),
    /// Every cluster that is not retrieved (costs only their value means).
    Rest,
}

/// The budget of a plan. The steady zone (sink + local window) is part of a context's
/// structure (`WaveParams`) and always attended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Attend every token exactly; the other fields are ignored.
    pub exact: bool,
    /// Fraction of tokens attended exactly in the retrieval zone.
    pub retrieve_frac: f64,
    /// Minimum tokens in the retrieval zone.
    pub retrieve_floor_tokens: usize,
    /// Share of the estimation zone.
    pub estimate: EstimateShare,
    /// Cluster choice per query head or per KV head.
    pub mode: SelectionMode,
    /// The planner picks exact attention when the sparse plan would read at least this
    /// fraction of the bytes exact attention reads (it would not be faster).
    pub exact_threshold: f64,
    /// Contexts of at most this many tokens are attended exactly: below some length a sparse
    /// plan's fixed costs (scoring every centroid, the estimation zone, dispatch) are the
    /// order of exact attention itself, so it saves little and still costs accuracy. 0 (the
    /// engine's default) turns the rule off; the engine cannot know the model's other costs,
    /// a runtime can (`attnstore_runtime::SHORT_CONTEXT_TOKENS`).
    pub short_context_tokens: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            exact: false,
            retrieve_frac: 0.018,
            retrieve_floor_tokens: 512,
            estimate: EstimateShare::Fraction(0.232),
            // Measured (docs/bench.md): at 128K per-KV-head selection is ~1.8x faster than
            // per-query-head for ~10% more output error; it is the default that meets the
            // speed goal, per-query-head stays one flag away.
            mode: SelectionMode::PerKvHead,
            exact_threshold: 0.5,
            short_context_tokens: 0,
        }
    }
}

impl Budget {
    /// Exact attention over every token.
    pub fn full() -> Self {
        Self { exact: true, ..Self::default() }
    }

    /// Sets the retrieval fraction.
    pub fn with_retrieve(mut self, frac: f64) -> Self {
        self.retrieve_frac = frac;
        self
    }

    /// Sets the retrieval floor in tokens.
    pub fn with_retrieve_floor(mut self, tokens: usize) -> Self {
        self.retrieve_floor_tokens = tokens;
        self
    }

    /// Sets the estimation share.
    pub fn with_estimate(mut self, share: EstimateShare) -> Self {
        self.estimate = share;
        self
    }

    /// Sets the share of exact attention's bytes at which a sparse plan is replaced by an
    /// exact one (0.5 by default; above 1, sparse plans are always kept).
    pub fn with_exact_threshold(mut self, share: f64) -> Self {
        self.exact_threshold = share;
        self
    }

    /// Sets the context length up to which plans are exact (0: off).
    pub fn with_short_context(mut self, tokens: usize) -> Self {
        self.short_context_tokens = tokens;
        self
    }

    /// Sets how clusters are chosen across a GQA group.
    pub fn with_mode(mut self, mode: SelectionMode) -> Self {
        self.mode = mode;
        self
    }

    /// Checks every field's range.
    pub fn validate(&self) -> Result<()> {
        let in_unit = |x: f64| x.is_finite() && (0.0..=1.0).contains(&x);
        if !in_unit(self.retrieve_frac) {
            return Err(Error::InvalidBudget(format!("retrieve fraction {} must be in [0, 1]", self.retrieve_frac)));
        }
        if let EstimateShare::Fraction(f) = self.estimate {
            if !in_unit(f) || self.retrieve_frac + f > 1.0 + 1e-9 {
                return Err(Error::InvalidBudget(format!(
                    "estimate fraction {f} must be in [0, 1] and retrieve + estimate ({}) at most 1",
                    self.retrieve_frac + f
                )));
            }
        }
        if !(self.exact_threshold.is_finite() && self.exact_threshold > 0.0) {
            return Err(Error::InvalidBudget(format!("exact threshold {} must be positive", self.exact_threshold)));
        }
        Ok(())
    }

    /// Token budgets for a context of `tokens` tokens.
    pub fn resolve(&self, tokens: usize) -> ZoneBudget {
        let retrieve = ((self.retrieve_frac * tokens as f64).ceil() as usize).max(self.retrieve_floor_tokens);
        let estimate = match self.estimate {
            EstimateShare::Fraction(f) => (f * tokens as f64).round() as usize,
            EstimateShare::Rest => usize::MAX,
        };
        ZoneBudget { retrieve_tokens: retrieve.min(tokens), estimate_tokens: estimate, mode: self.mode }
    }

    /// One line for EXPLAIN.
    pub fn describe(&self) -> String {
        if self.exact {
            return "full (exact)".into();
        }
        let est = match self.estimate {
            EstimateShare::Fraction(f) => format!("{:.1}%", f * 100.0),
            EstimateShare::Rest => "rest".into(),
        };
        format!(
            "retrieve {:.1}% (floor {} tokens), estimate {est}, selection {}",
            self.retrieve_frac * 100.0,
            self.retrieve_floor_tokens,
            self.mode.name()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_budgets_are_rejected() {
        assert!(Budget::default().validate().is_ok());
        assert!(Budget::default().with_retrieve(1.5).validate().is_err());
        assert!(Budget::default().with_retrieve(f64::NAN).validate().is_err());
        assert!(Budget::default().with_retrieve(0.9).validate().is_err(), "0.9 + 0.232 > 1");
        assert!(Budget::default().with_estimate(EstimateShare::Fraction(-0.1)).validate().is_err());
        assert!(Budget::default().with_retrieve(0.9).with_estimate(EstimateShare::Rest).validate().is_ok());
    }

    #[test]
    fn floor_applies_to_short_contexts_only() {
        let b = Budget::default();
        assert_eq!(b.resolve(4096).retrieve_tokens, 512);
        assert_eq!(b.resolve(131072).retrieve_tokens, 2360);
        assert_eq!(b.resolve(100).retrieve_tokens, 100);
    }
}
