//! `GET /metrics` in Prometheus' text format: requests by path and status, token counts, the
//! queue, and latency histograms. Counters are atomics (and one small map), updated by the
//! request middleware and the engine thread, so reading them never waits on a generation.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use serde_json::json;

use super::engine::Outcome;
use super::request_id::{ClientAddr, new_request_id, scoped};

/// Paths reported by name; anything else is "other", so that clients cannot grow the map.
const PATHS: [&str; 11] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/models/{id}",
];

/// Upper bounds in seconds: from a short prompt on a GPU to a long prefill on a CPU.
const TTFT_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const INTER_TOKEN_BUCKETS: [f64; 11] = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
];

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    /// Requests accepted but not yet taken by the engine.
    pub queued: AtomicUsize,
    /// Generations in the engine's batch (at most `--max-batch`).
    pub running: AtomicUsize,
    pub time_to_first_token: Histogram<12>,
    pub inter_token: Histogram<11>,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Metrics {
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token: Histogram::new(INTER_TOKEN_BUCKETS),
            ..Metrics::default()
        })
    }

    /// Counts a request; its path as labelled.
    pub fn count_request(&self, path: &str, status: u16) -> &'static str {
        let label = PATHS.iter().find(|p| **p == path).copied().unwrap_or(
            if path.starts_with("/v1/models/") {
                "/v1/models/{id}"
            } else {
                "other"
            },
        );
        // A poisoned lock only means another thread panicked mid-increment; the map is intact.
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests.entry((label, status)).or_default() += 1;
        label
    }

    pub fn count_outcome(&self, outcome: &Outcome) {
        let add = |counter: &AtomicU64, n: usize| counter.fetch_add(n as u64, Ordering::Relaxed);
        add(&self.prompt_tokens, outcome.prompt_tokens);
        add(&self.cached_prompt_tokens, outcome.cached_tokens);
        add(&self.generated_tokens, outcome.completion_tokens());
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP lily_requests_total HTTP requests answered, by path and status.\n\
             # TYPE lily_requests_total counter"
        );
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        for ((path, status), n) in requests.iter() {
            let _ = writeln!(
                out,
                "lily_requests_total{{path=\"{path}\",status=\"{status}\"}} {n}"
            );
        }
        drop(requests);
        let counters = [
            (
                "lily_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "lily_cached_prompt_tokens_total",
                "Prompt tokens restored from a snapshot (cache hits).",
                &self.cached_prompt_tokens,
            ),
            (
                "lily_generated_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
        ];
        for (name, help, counter) in counters {
            let n = counter.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {n}"
            );
        }
        let queued = self.queued.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP lily_queue_depth Requests waiting for the engine.\n\
             # TYPE lily_queue_depth gauge\nlily_queue_depth {queued}"
        );
        let running = self.running.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP lily_running_generations Generations in the engine's batch.\n\
             # TYPE lily_running_generations gauge\nlily_running_generations {running}"
        );
        self.time_to_first_token.render(
            &mut out,
            "lily_time_to_first_token_seconds",
            "From a request's arrival in the queue to its first generated text.",
        );
        self.inter_token.render(
            &mut out,
            "lily_inter_token_latency_seconds",
            "Between successive pieces of generated text of one request.",
        );
        out
    }
}

pub struct Histogram<const N: usize> {
    bounds: [f64; N],
    /// Not cumulative; `render` sums them.
    counts: [AtomicU64; N],
    above: AtomicU64,
    sum_micros: AtomicU64,
}

impl<const N: usize> Default for Histogram<N> {
    fn default() -> Self {
        Self::new([f64::INFINITY; N])
    }
}

impl<const N: usize> Histogram<N> {
    fn new(bounds: [f64; N]) -> Self {
        Histogram {
            bounds,
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            above: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        match self.bounds.iter().position(|&b| seconds <= b) {
            Some(i) => self.counts[i].fetch_add(1, Ordering::Relaxed),
            None => self.above.fetch_add(1, Ordering::Relaxed),
        };
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            total += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {total}");
        }
        total += self.above.load(Ordering::Relaxed);
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {total}\n{name}_sum {sum}\n{name}_count {total}"
        );
    }
}

/// The middleware that counts every answered request and logs one JSON line for it: its id
/// (also the response's `x-request-id`, and on the engine's lines about it), the client's
/// address, method, path (as the metrics label it), status, and the time until the response's
/// headers (a stream goes on after that). Never the prompt or any other part of the body.
pub async fn track(State(metrics): State<Arc<Metrics>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let id = new_request_id();
    let client = request
        .extensions()
        .get::<ClientAddr>()
        .map(|c| c.0.to_string());
    let method = match *request.method() {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::PATCH
        | Method::OPTIONS
        | Method::HEAD => request.method().to_string(),
        _ => "other".into(),
    };
    let path = request.uri().path().to_string();
    let mut response = scoped(id.clone(), next.run(request)).await;
    let status = response.status().as_u16();
    let label = metrics.count_request(&path, status);
    let line = json!({"event": "request", "id": id, "client": client, "method": method,
                      "path": label, "status": status,
                      "headers_ms": (started.elapsed().as_secs_f64() * 1e4).round() / 10.0});
    eprintln!("lily: {line}");
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

pub fn metrics_response(metrics: &Metrics) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_paths_are_bounded() {
        let metrics = Metrics::new();
        metrics
            .time_to_first_token
            .observe(Duration::from_millis(30));
        metrics
            .time_to_first_token
            .observe(Duration::from_millis(70));
        metrics
            .time_to_first_token
            .observe(Duration::from_secs(600));
        metrics.count_request("/v1/chat/completions", 200);
        metrics.count_request("/v1/chat/completions", 200);
        metrics.count_request("/v1/models/anything", 404);
        metrics.count_request("/random/path", 404);
        let text = metrics.render();
        for line in [
            "lily_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "lily_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "lily_time_to_first_token_seconds_bucket{le=\"0.1\"} 2",
            "lily_time_to_first_token_seconds_bucket{le=\"60\"} 2",
            "lily_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3",
            "lily_time_to_first_token_seconds_count 3",
            "lily_time_to_first_token_seconds_sum 600.1",
            "lily_requests_total{path=\"/v1/chat/completions\",status=\"200\"} 2",
            "lily_requests_total{path=\"/v1/models/{id}\",status=\"404\"} 1",
            "lily_requests_total{path=\"other\",status=\"404\"} 1",
            "lily_queue_depth 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
        }
    }
}
