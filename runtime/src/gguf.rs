//! Reading GGUF metadata with typed errors: every failure is `Error::BadModel` naming the
//! key (shared by the model's configuration and the tokenizer).

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, Value};

/// A GGUF file's metadata.
pub(crate) struct Meta<'a>(pub(crate) &'a Content);

impl Meta<'_> {
    /// The value of a key that must be present.
    pub(crate) fn get(&self, key: &str) -> Result<&Value> {
        self.0
            .metadata
            .get(key)
            .ok_or_else(|| Error::BadModel { what: key.into(), detail: "metadata key missing".into() })
    }

    fn bad(key: &str, e: candle_core::Error) -> Error {
        Error::BadModel { what: key.into(), detail: e.to_string() }
    }

    /// A required string.
    pub(crate) fn string(&self, key: &str) -> Result<String> {
        self.get(key)?.to_string().cloned().map_err(|e| Self::bad(key, e))
    }

    /// A required `u32`.
    pub(crate) fn u32(&self, key: &str) -> Result<u32> {
        self.get(key)?.to_u32().map_err(|e| Self::bad(key, e))
    }

    /// A required `f32`.
    pub(crate) fn f32(&self, key: &str) -> Result<f32> {
        self.get(key)?.to_f32().map_err(|e| Self::bad(key, e))
    }

    /// An optional value read by `read` (`Value::to_f32`, `Value::to_bool`, ...): `None` when
    /// the key is absent, an error when it holds another type.
    pub(crate) fn optional<T>(&self, key: &str, read: impl Fn(&Value) -> candle_core::Result<T>) -> Result<Option<T>> {
        self.0.metadata.get(key).map(|v| read(v).map_err(|e| Self::bad(key, e))).transpose()
    }

    /// A required array of strings.
    pub(crate) fn strings(&self, key: &str) -> Result<Vec<String>> {
        self.get(key)?
            .to_vec()
            .map_err(|e| Self::bad(key, e))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| Self::bad(key, e)))
            .collect()
    }

    /// Per-token values of an optional array, `default` when the key is absent.
    pub(crate) fn per_token<T: Copy>(
        &self,
        key: &str,
        n: usize,
        default: T,
        read: impl Fn(&Value) -> candle_core::Result<T>,
    ) -> Result<Vec<T>> {
        let Some(v) = self.0.metadata.get(key) else { return Ok(vec![default; n]) };
        let values = v.to_vec().map_err(|e| Self::bad(key, e))?;
        if values.len() != n {
            return Err(Error::BadModel {
                what: key.into(),
                detail: format!("{} entries, expected one per token ({n})", values.len()),
            });
        }
        values.iter().map(|v| read(v).map_err(|e| Self::bad(key, e))).collect()
    }
}
