//! Partials: the online-softmax state `(o, m, l)` of attention over a subset of tokens, and
//! their exact log-sum-exp merge (the glue between zones, chunks and backends).

/// Attention of one query head over some subset of tokens, not yet normalized:
/// `m = max score`, `l = Σ exp(s − m)`, `o = Σ exp(s − m)·v`. Merging two partials of
/// disjoint token sets gives exactly the partial of their union.
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    /// Running maximum of the (scaled) scores; `-∞` for an empty set.
    pub m: f32,
    /// Sum of `exp(s − m)` (the softmax denominator relative to `m`).
    pub l: f32,
    /// Sum of `exp(s − m)·v`, `head_dim` values.
    pub o: Vec<f32>,
}

/// `e^delta` for `delta ≤ 0`, flushed to zero where it would be subnormal: a weight that
/// small cannot change the f32 sums it scales, and subnormal operands cost a microcode
/// assist per instruction on many x86 cores (the partial's `o` would stay subnormal for
/// every later update).
#[inline]
pub(crate) fn decay(delta: f32) -> f32 {
    let c = delta.exp();
    if c < f32::MIN_POSITIVE {
        0.0
    } else {
        c
    }
}

impl Partial {
    /// The partial of no tokens.
    pub fn empty(head_dim: usize) -> Self {
        Self { m: f32::NEG_INFINITY, l: 0.0, o: vec![0.0; head_dim] }
    }

    /// True when no token (or only zero-weight tokens) contributed.
    pub fn is_empty(&self) -> bool {
        self.l == 0.0
    }

    /// Rescales this partial to a new maximum `m_new >= self.m`.
    #[inline]
    pub(crate) fn rescale_to(&mut self, m_new: f32) {
        if self.m == m_new {
            return;
        }
        let c = if self.m == f32::NEG_INFINITY { 0.0 } else { decay(self.m - m_new) };
        self.l *= c;
        super::simd::scale_in_place(c, &mut self.o);
        self.m = m_new;
    }

    /// Merges `other` into `self` by log-sum-exp: the result is the partial of both subsets.
    pub fn merge(&mut self, other: &Partial) {
        debug_assert_eq!(self.o.len(), other.o.len());
        if other.m == f32::NEG_INFINITY {
            return;
        }
        let m = self.m.max(other.m);
        self.rescale_to(m);
        let c = decay(other.m - m);
        self.l += other.l * c;
        super::simd::axpy(c, &other.o, &mut self.o);
    }

    /// Normalizes into the attention output `o / l` (zeros for an empty partial).
    pub fn finish(&self) -> Vec<f32> {
        if self.l == 0.0 {
            return vec![0.0; self.o.len()];
        }
        let inv = 1.0 / self.l;
        self.o.iter().map(|x| x * inv).collect()
    }

    /// The log of the softmax denominator, `m + ln l`.
    pub fn lse(&self) -> f32 {
        self.m + self.l.ln()
    }
}

/// Merges any number of partials of disjoint token sets into one.
pub fn merge_all<'a>(head_dim: usize, parts: impl IntoIterator<Item = &'a Partial>) -> Partial {
    let mut acc = Partial::empty(head_dim);
    for p in parts {
        acc.merge(p);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_too_small_for_a_normal_float_are_flushed_to_zero() {
        assert_eq!(decay(-10.0), (-10.0f32).exp());
        assert_eq!(decay(-87.0), (-87.0f32).exp());
        assert_eq!(decay(-100.0), 0.0);
        // A partial far below another merges to exactly the larger one, no subnormals left.
        let big = Partial { m: 0.0, l: 1.5, o: vec![1.0, -2.0] };
        let mut a = Partial { m: -120.0, l: 3.0, o: vec![4.0, 5.0] };
        a.merge(&big);
        assert_eq!(a, big);
        let mut b = big.clone();
        b.merge(&Partial { m: -120.0, l: 3.0, o: vec![4.0, 5.0] });
        assert_eq!(b, big);
    }

    #[test]
    fn merging_with_empty_is_identity() {
        let p = Partial { m: 1.5, l: 2.0, o: vec![1.0, -2.0] };
        let mut a = p.clone();
        a.merge(&Partial::empty(2));
        assert_eq!(a, p);
        let mut e = Partial::empty(2);
        e.merge(&p);
        assert_eq!(e, p);
        assert_eq!(Partial::empty(3).finish(), vec![0.0; 3]);
    }
}
