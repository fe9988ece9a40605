//! A PQ index's base rows homed in the engine's row home (its buffer manager) instead of
//! the index's memory ([`PqIndex::with_home`]). When the codebook build starts, the base
//! rows past the sink of every KV head go to the home in pages of [`PAGE_TOKENS`] rows:
//! page `c` is home cluster `c` of the head. The sink and the tail (decode tokens) stay in
//! the index. A plan's retrieved tokens are read from the pages' blocks (one block per few
//! tokens: the executor pins only the blocks that hold a chosen row), an exact plan scans
//! every page. Only plain rows are homed: a `hack2` or `kv43` index keeps its encoded rows,
//! whose durable home is the checkpoint's encoded home (`home.rs`).

use super::PqIndex;
use crate::error::{Error, Result};
use crate::home::RowHome;
use crate::rows::HomedClusters;
use attnstore_kernels::Element;
use std::ops::Range;
use std::sync::Arc;

/// Rows per page of a homed base.
pub(crate) const PAGE_TOKENS: usize = 256;

/// Where a homed index's base rows past the sink are: page `c` of every KV head is home
/// cluster `c`, holding those rows `starts[c]..starts[c + 1]`.
#[derive(Debug, Clone, Default)]
pub(super) struct HomedBase {
    /// First row of every page, then the rows past the sink.
    starts: Vec<u32>,
}

impl HomedBase {
    /// The pages as the executor reads them.
    pub(super) fn clusters<E: Element>(&self) -> HomedClusters<'_> {
        HomedClusters { first: 0, starts: &self.starts, dtype: E::DTYPE }
    }

    /// Rows past the sink.
    pub(super) fn rows(&self) -> usize {
        self.starts.last().map_or(0, |&r| r as usize)
    }

    fn pages(&self) -> u32 {
        self.starts.len().saturating_sub(1) as u32
    }

    /// Frees every page of every head.
    pub(super) fn free(&self, home: &dyn RowHome, kv_heads: usize) {
        for h in 0..kv_heads {
            home.free(h, 0..self.pages());
        }
    }
}

impl<E: Element> PqIndex<E> {
    /// Homes the base rows past the sink in `home` (the engine's buffer manager) from the
    /// codebook build on. Only an empty index with plain rows can be homed: a `hack2` or
    /// `kv43` index keeps its encoded rows. A row that does not fit one block of the home is
    /// a typed error.
    pub fn with_home(mut self, home: Arc<dyn RowHome>) -> Result<Self> {
        if self.tokens > 0 || self.codec.is_encoded() {
            return Err(Error::InvalidParameter {
                what: "row home",
                message: "only an empty pq index with plain rows can home them (a hack2 or kv43 index keeps its encoded rows)"
                    .into(),
            });
        }
        home.check_row_bytes(self.head_dim * E::DTYPE.size_bytes())?;
        self.home = Some(home);
        Ok(self)
    }

    /// True when the base rows past the sink live (or will live, once the build starts) in
    /// a row home.
    pub fn is_homed(&self) -> bool {
        self.home.is_some()
    }

    /// Stores rows `start..` of every head's tail (all the index's tokens, before the base
    /// is made) in the home, page by page: all of them or none. `None` without a home.
    pub(super) fn home_base(&self, start: usize) -> Result<Option<HomedBase>> {
        let Some(home) = self.home.as_deref() else { return Ok(None) };
        let (d, row_bytes) = (self.head_dim, self.head_dim * E::DTYPE.size_bytes());
        let n = self.tokens - start;
        let starts: Vec<u32> = (0..n).step_by(PAGE_TOKENS).chain([n]).map(|r| r as u32).collect();
        let base = HomedBase { starts };
        for (h, kv) in self.heads.iter().enumerate() {
            for (c, page) in (0u32..).zip(base.starts.windows(2)) {
                let rows = (start + page[0] as usize) * d..(start + page[1] as usize) * d;
                let (k, v) = (&kv.tail_keys[rows.clone()], &kv.tail_values[rows]);
                if let Err(e) = home.store_rows(h, c, bytemuck::cast_slice(k), bytemuck::cast_slice(v), row_bytes) {
                    (0..h).for_each(|done| home.free(done, 0..base.pages()));
                    home.free(h, 0..c);
                    return Err(e);
                }
            }
        }
        Ok(Some(base))
    }

    /// Keys of head `h`'s homed base rows `rows` (past the sink), widened, read from the
    /// pages that hold them.
    pub(super) fn homed_keys(&self, h: usize, base: &HomedBase, rows: Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let Some(home) = self.home.as_deref() else {
            return Err(Error::MissingRows("a homed pq base without a row home".into()));
        };
        let (d, row_bytes) = (self.head_dim, self.head_dim * E::DTYPE.size_bytes());
        for (page, within) in base.clusters::<E>().clusters_of(rows) {
            let (c, s) = (page as usize, &base.starts);
            let (keys, _) = home.read_rows(h, page, (s[c + 1] - s[c]) as usize, row_bytes)?;
            let mut rows = vec![E::default(); within.len() * d];
            bytemuck::cast_slice_mut::<E, u8>(&mut rows)
                .copy_from_slice(&keys[within.start * row_bytes..within.end * row_bytes]);
            let at = out.len();
            out.resize(at + within.len() * d, 0.0);
            E::widen(&rows, &mut out[at..]);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::AccessMethod;
    use crate::pq::PqParams;
    use attnstore_kernels::random::SplitMix64;
    use half::f16;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Each stored cluster's key and value bytes, by (KV head, cluster).
    type Clusters = HashMap<(usize, u32), (Vec<u8>, Vec<u8>)>;

    /// A row home in memory: each cluster's keys and values as given, with a capacity in
    /// clusters to make it fail.
    #[derive(Debug, Default)]
    struct MemHome {
        clusters: Mutex<Clusters>,
        capacity: usize,
    }

    impl RowHome for MemHome {
        fn check_row_bytes(&self, _row_bytes: usize) -> Result<()> {
            Ok(())
        }
        fn store_rows(&self, head: usize, cluster: u32, keys: &[u8], values: &[u8], _: usize) -> Result<()> {
            let mut c = self.clusters.lock().unwrap();
            if c.len() >= self.capacity {
                return Err(Error::MissingRows("the test home is full".into()));
            }
            assert!(c.insert((head, cluster), (keys.to_vec(), values.to_vec())).is_none(), "stored twice");
            Ok(())
        }
        fn store_bytes(&self, _: usize, _: u32, _: &[u8]) -> Result<()> {
            unreachable!("pq homes plain rows only")
        }
        fn free(&self, head: usize, ids: Range<u32>) {
            let mut c = self.clusters.lock().unwrap();
            ids.for_each(|id| drop(c.remove(&(head, id))));
        }
        fn read(&self, _: usize, _: &[u32]) -> Result<Vec<Vec<u8>>> {
            unreachable!("pq reads rows")
        }
        fn read_rows(&self, head: usize, cluster: u32, rows: usize, row_bytes: usize) -> Result<(Vec<u8>, Vec<u8>)> {
            let c = self.clusters.lock().unwrap();
            let (k, v) = c.get(&(head, cluster)).ok_or_else(|| Error::MissingRows(format!("{head}/{cluster}")))?;
            Ok((k[..rows * row_bytes].to_vec(), v[..rows * row_bytes].to_vec()))
        }
    }

    fn batch(rng: &mut SplitMix64, heads: usize, n: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
        (rng.normals(heads * n * d), rng.normals(heads * n * d))
    }

    #[test]
    fn a_homed_base_codes_decode_tokens_from_the_rows_it_reads_back_and_frees_them_on_drop() {
        let (heads, d) = (2, 16);
        let params = PqParams { min_build_tokens: 512, local_tokens: 48, background: false, ..PqParams::default() };
        let home = Arc::new(MemHome { capacity: usize::MAX, ..MemHome::default() });
        let mut plain = PqIndex::<f16>::new(params, heads, d).unwrap();
        let mut homed = PqIndex::<f16>::new(params, heads, d).unwrap().with_home(home.clone()).unwrap();
        let mut rng = SplitMix64::new(3);
        let (k, v) = batch(&mut rng, heads, 1000, d);
        plain.append(&k, &v).unwrap();
        homed.append(&k, &v).unwrap();
        // 996 rows past the sink in pages of 256: 4 pages per head.
        assert_eq!(home.clusters.lock().unwrap().len(), 2 * 4);
        for _ in 0..6 {
            let (k, v) = batch(&mut rng, heads, 17, d);
            plain.append(&k, &v).unwrap();
            homed.append(&k, &v).unwrap();
        }
        // The local window at build time (base rows 952..1000, homed) is coded now, from keys
        // read back out of the home: the same codes as from the index's own rows.
        assert_eq!(homed.coded_end(), plain.coded_end());
        assert!(homed.coded_end() > 1000);
        for h in 0..heads {
            for p in 0..homed.tokens {
                assert_eq!(homed.codes_of(h, p), plain.codes_of(h, p), "head {h} position {p}");
            }
        }
        drop(homed);
        assert!(home.clusters.lock().unwrap().is_empty());
    }

    #[test]
    fn a_home_that_fills_fails_the_batch_and_leaves_the_index_as_it_was() {
        let (heads, d) = (2, 16);
        let params = PqParams { min_build_tokens: 512, local_tokens: 48, background: false, ..PqParams::default() };
        let home = Arc::new(MemHome { capacity: 5, ..MemHome::default() });
        let mut homed = PqIndex::<f16>::new(params, heads, d).unwrap().with_home(home.clone()).unwrap();
        let mut rng = SplitMix64::new(5);
        let (k, v) = batch(&mut rng, heads, 100, d);
        homed.append(&k, &v).unwrap();
        let (k, v) = batch(&mut rng, heads, 900, d);
        assert!(homed.append(&k, &v).is_err());
        assert_eq!((homed.tokens, homed.stats().tokens), (100, 100));
        assert!(homed.build.is_none() && homed.homed.is_none());
        assert!(home.clusters.lock().unwrap().is_empty(), "what was stored was freed");
        assert!(homed.heads.iter().all(|kv| kv.tail_keys.len() == 100 * d && kv.tail_values.len() == 100 * d));
        // A 2-bit index, or one with rows, cannot be homed.
        let hack = PqIndex::<f16>::new(params, heads, d)
            .unwrap()
            .with_codec(crate::RowCodec::Hack2(attnstore_kernels::HackParams::default()));
        assert!(hack.unwrap().with_home(home.clone()).is_err());
        let mut filled = PqIndex::<f16>::new(params, heads, d).unwrap();
        filled.append(&k, &v).unwrap();
        assert!(filled.with_home(home).is_err());
    }
}
