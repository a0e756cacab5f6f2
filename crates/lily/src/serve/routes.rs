//! The router, what every handler shares, and the small endpoints (`/v1/models`, `/health`).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use lily_chat::TextModel;
use serde_json::{Value, json};

use super::access::{Access, guard};
use super::chat::chat_completions;
use super::completions::completions;
use super::constrained::GrammarEngine;
use super::engine::{GenerationJob, Outcome};
use super::error::{ApiError, ApiResult};
use super::messages::{count_tokens, messages};
use super::metrics::{Metrics, metrics_response, track};
use super::request::CommonRequest;
use super::responses::{ResponseStore, responses};
use super::sampling_defaults::SamplingDefaults;
use super::tokenize::{detokenize, tokenize};
use super::worker::EngineHandle;

pub struct AppState {
    pub engine: EngineHandle,
    pub text: Arc<TextModel>,
    /// The name clients must send as `model`.
    pub model_name: String,
    /// Other names accepted for it (the `--model` argument as given).
    pub model_aliases: Vec<String>,
    pub created: u64,
    pub max_seq: usize,
    /// `--max-tokens`: the reply length of a request that sets none (cut to what the context
    /// has left); `None`: the rest of the context.
    pub default_max_tokens: Option<usize>,
    pub vocab_size: usize,
    pub defaults: SamplingDefaults,
    pub default_thinking: bool,
    /// The largest request body; a larger one is a 413.
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
    /// Shared with the engine thread.
    pub metrics: Arc<Metrics>,
    /// Conversations kept for `/v1/responses`' `previous_response_id`.
    pub responses: Arc<ResponseStore>,
    /// Grammars for `response_format` and forced tool calls.
    pub grammars: GrammarEngine,
}

impl AppState {
    pub fn check_model(&self, requested: &str) -> ApiResult<()> {
        if requested == self.model_name || self.model_aliases.iter().any(|a| a == requested) {
            return Ok(());
        }
        Err(ApiError::model_not_found(requested, &self.model_name))
    }

    /// The job for a tokenised prompt: a prompt that leaves no room in the context, or a
    /// `max_tokens` beyond what it leaves, is a 400 that says the numbers (as OpenAI and vLLM
    /// answer); a request without one gets the server's `--max-tokens` (else the endpoint's
    /// default, else the rest of the context), cut to the room left.
    pub fn job(
        &self,
        prompt: Vec<u32>,
        turn_boundary: Option<usize>,
        request: &CommonRequest,
        prompt_param: &str,
    ) -> ApiResult<GenerationJob> {
        if prompt.is_empty() {
            return Err(ApiError::param(prompt_param, "the prompt has no tokens"));
        }
        if prompt.len() >= self.max_seq {
            let mut error = ApiError::context_length(prompt.len(), self.max_seq);
            error.param = Some(prompt_param.to_string());
            return Err(error);
        }
        if let Some(&(id, _)) = request
            .penalties
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= self.vocab_size)
        {
            return Err(ApiError::param(
                format!("logit_bias.{id}"),
                format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        let room = self.max_seq - prompt.len();
        let max_tokens = match request.max_tokens {
            Some(asked) if request.max_tokens_asked && asked > room => {
                return Err(ApiError::reply_too_long(prompt.len(), asked, self.max_seq));
            }
            Some(asked) if request.max_tokens_asked => asked,
            // The server's default first, then the endpoint's; either is cut to fit.
            endpoint => self
                .default_max_tokens
                .or(endpoint)
                .map_or(room, |n| n.min(room)),
        };
        Ok(GenerationJob {
            prompt,
            turn_boundary,
            max_tokens,
            sampling: request.sampling.clone(),
            penalties: request.penalties.clone(),
            stop: request.stop.clone(),
            n: request.n,
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
        })
    }
}

pub fn router(app: Arc<AppState>, access: Arc<Access>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses))
        // Where llama.cpp and vLLM serve them: outside /v1, which is OpenAI's.
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("this path").into_response() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        // Outermost, so that unknown paths too are hidden from whoever lacks the key.
        .layer(from_fn_with_state(access, guard))
        // Outside the key check, so that refusals are counted too.
        .layer(from_fn_with_state(app.metrics.clone(), track))
        .with_state(app)
}

/// The body, at most `app.max_body_bytes`; all of it within `app.body_timeout`, or a 408, so
/// that a client trickling bytes cannot hold a connection and its buffer for long.
pub async fn read_body(body: Body, app: &AppState) -> ApiResult<Bytes> {
    match tokio::time::timeout(app.body_timeout, read_limited(body, app.max_body_bytes)).await {
        Ok(read) => read,
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            ..ApiError::invalid(format!(
                "the request body did not arrive within {} s (--body-timeout-s)",
                app.body_timeout.as_secs_f64()
            ))
        }),
    }
}

/// At most `limit` bytes. A larger body is a 413, answered only after reading (and dropping)
/// up to as much again: closing on a client that is still sending resets the connection, and it
/// would never see why.
async fn read_limited(body: Body, limit: usize) -> ApiResult<Bytes> {
    let mut stream = body.into_data_stream();
    let mut data = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::invalid(format!("the request body could not be read: {e}")))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= limit {
            data.extend_from_slice(&chunk);
        } else if seen > limit.saturating_mul(2) {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            ..ApiError::invalid(format!(
                "the request body is larger than this server's limit of {limit} bytes \
                 (--max-body-mb)"
            ))
        });
    }
    Ok(data.into())
}

pub fn outcome_usage(outcome: &Outcome) -> Value {
    let completion = outcome.completion_tokens();
    json!({
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": outcome.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    })
}

fn model_object(app: &AppState) -> Value {
    json!({"id": app.model_name, "object": "model", "created": app.created, "owned_by": "lily",
           "max_model_len": app.max_seq})
}

async fn models(State(app): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

/// An id that is not valid UTF-8 once percent-decoded names no model: a 404 like any other.
async fn model(
    State(app): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(_) => return ApiError::model_not_found("(not UTF-8)", &app.model_name).into_response(),
    };
    match app.check_model(&id) {
        Ok(()) => Json(model_object(&app)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    metrics_response(&app.metrics)
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    if app.engine.is_alive() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        ApiError::unavailable("the generation engine has stopped").into_response()
    }
}
