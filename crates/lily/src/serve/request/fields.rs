//! Typed access to request fields, and the sampling fields with rules of their own (stop
//! strings, logit_bias), each error naming the field.

use serde_json::{Map, Value};

use crate::serve::error::{ApiError, ApiResult};

/// The most stop strings a request may give: each is checked after every token.
const MAX_STOP_STRINGS: usize = 16;
/// OpenAI's limit on one `logit_bias` value, and on how many it takes.
const MAX_LOGIT_BIAS: f64 = 100.0;
const MAX_LOGIT_BIAS_ENTRIES: usize = 300;

/// `{"token id": bias}`, as OpenAI sends it (ids as strings; numbers are taken too).
pub(super) fn parse_logit_bias(value: Option<&Value>) -> ApiResult<Vec<(u32, f32)>> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(ApiError::param(
                "logit_bias",
                "must be an object of token ids to biases",
            ));
        }
    };
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(ApiError::param(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed"),
        ));
    }
    map.iter()
        .map(|(id, bias)| {
            let param = format!("logit_bias.{id}");
            let id = id.trim().parse::<u32>().map_err(|_| {
                ApiError::param(&param, "keys must be token ids (non-negative integers)")
            })?;
            match bias.as_f64() {
                Some(b) if (-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::param(
                    &param,
                    format!("must be a number in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
                )),
            }
        })
        .collect()
}

pub(super) fn parse_stop(value: Option<&Value>) -> ApiResult<Vec<String>> {
    let stops = match value {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::param("stop", "must be a string or a list of strings"))?,
        Some(_) => {
            return Err(ApiError::param(
                "stop",
                "must be a string or a list of strings",
            ));
        }
    };
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::param(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::param("stop", "stop strings must not be empty"));
    }
    Ok(stops)
}

/// Typed access to the body's fields, with errors that name them.
pub(super) struct Fields<'a>(pub(super) &'a Map<String, Value>);

impl Fields<'_> {
    pub(super) fn number(&self, name: &str) -> ApiResult<Option<f64>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::param(name, "must be a number")),
        }
    }

    /// A number in `[lo, hi]` (or `(lo, hi]` when `lo_inclusive` is false).
    pub(super) fn ranged(
        &self,
        name: &str,
        lo: f64,
        hi: f64,
        lo_inclusive: bool,
    ) -> ApiResult<Option<f32>> {
        let Some(x) = self.number(name)? else {
            return Ok(None);
        };
        let above = if lo_inclusive { x >= lo } else { x > lo };
        if !(above && x <= hi) {
            let open = if lo_inclusive { '[' } else { '(' };
            return Err(ApiError::param(
                name,
                format!("must be in {open}{lo}, {hi}], got {x}"),
            ));
        }
        Ok(Some(x as f32))
    }

    pub(super) fn flag(&self, name: &str) -> ApiResult<Option<bool>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::param(name, "must be true or false")),
        }
    }

    pub(super) fn count(&self, name: &str) -> ApiResult<Option<usize>> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| ApiError::param(name, "must be a non-negative integer")),
        }
    }

    /// The field may be absent, null, or one of `neutral` (values that change nothing).
    pub(super) fn require_neutral(
        &self,
        name: &str,
        neutral: &[Value],
        what: &str,
    ) -> ApiResult<()> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if neutral.iter().any(|n| same_value(n, v)) => Ok(()),
            Some(_) => Err(ApiError::unsupported(name, what)),
        }
    }
}

/// JSON equality that treats 1 and 1.0 alike.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}
