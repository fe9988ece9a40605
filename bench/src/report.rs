//! Bench output: one record per measured configuration, printed as a table for people and
//! as JSON lines (stable field names from BENCH.md) for machines.

use serde_json::{Map, Value};

/// One measured configuration.
#[derive(Debug, Clone, Default)]
pub struct Row {
    fields: Map<String, Value>,
}

impl Row {
    /// A row of bench kind `bench` (e.g. `decode`, `index_build`, `memread`).
    pub fn new(bench: &str, method: &str) -> Self {
        let mut r = Self::default();
        r.set("bench", bench).set("method", method).set("device", "cpu");
        r
    }

    /// Sets a field (numbers, strings, booleans).
    pub fn set(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        let v = value.into();
        let v = match v {
            Value::Number(n) if n.as_f64().is_some_and(|f| f.fract() != 0.0) => {
                // Keep JSON short: 4 significant decimals are far below the noise of any figure here.
                let f = n.as_f64().unwrap_or_default();
                Value::from((f * 1e4).round() / 1e4)
            }
            other => other,
        };
        self.fields.insert(key.to_string(), v);
        self
    }

    /// A field's value, if set.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.fields.get(key)
    }

    /// The row as one JSON line.
    pub fn json(&self) -> String {
        Value::Object(self.fields.clone()).to_string()
    }
}

const COLUMNS: [(&str, &str, usize); 13] = [
    ("tokens", "tokens", 7),
    ("bench", "bench", 11),
    ("method", "method", 11),
    ("selection", "selection", 14),
    ("estimate_frac", "est", 5),
    ("time_us", "time_us", 9),
    ("baseline", "baseline", 8),
    ("speedup", "ratio", 7),
    ("gbps", "GB/s", 6),
    ("rel_l2_error", "rel_l2", 7),
    ("oracle_rel_l2_error", "oracle", 7),
    ("recall", "recall", 6),
    ("exact_tokens", "exact_tok", 9),
];

/// A fixed-width table of rows (missing fields print as `-`).
pub fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    for (_, title, w) in COLUMNS {
        s.push_str(&format!("{title:>w$} "));
    }
    s.push_str(" MB read\n");
    for r in rows {
        for (key, _, w) in COLUMNS {
            let cell = match r.get(key) {
                Some(Value::Number(n)) => match n.as_f64() {
                    Some(f) if f.fract() != 0.0 && f.abs() < 10.0 => format!("{f:.4}"),
                    Some(f) if f.fract() != 0.0 => format!("{f:.1}"),
                    _ => n.to_string(),
                },
                Some(Value::String(t)) => t.clone(),
                Some(v) => v.to_string(),
                None => "-".into(),
            };
            s.push_str(&format!("{cell:>w$} "));
        }
        match r.get("bytes_host").and_then(Value::as_f64) {
            Some(b) => s.push_str(&format!(" {:.1}\n", b / 1e6)),
            None => s.push_str(" -\n"),
        }
    }
    s
}
