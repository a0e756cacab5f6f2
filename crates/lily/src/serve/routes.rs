//! The router, what every handler shares, and the small endpoints (`/v1/models`, `/health`).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use lily_chat::TextModel;
use serde_json::{Value, json};

use super::chat::chat_completions;
use super::completions::completions;
use super::engine::{GenerationJob, Outcome};
use super::error::{ApiError, ApiResult};
use super::request::CommonRequest;
use super::sampling_defaults::SamplingDefaults;
use super::worker::EngineHandle;

/// Long conversations are megabytes of JSON; axum's default limit is 2 MB.
const MAX_BODY_BYTES: usize = 64 << 20;

pub struct AppState {
    pub engine: EngineHandle,
    pub text: Arc<TextModel>,
    /// The name clients must send as `model`.
    pub model_name: String,
    /// Other names accepted for it (the `--model` argument as given).
    pub model_aliases: Vec<String>,
    pub created: u64,
    pub max_seq: usize,
    pub vocab_size: usize,
    pub defaults: SamplingDefaults,
    pub default_thinking: bool,
}

impl AppState {
    pub fn check_model(&self, requested: &str) -> ApiResult<()> {
        if requested == self.model_name || self.model_aliases.iter().any(|a| a == requested) {
            return Ok(());
        }
        Err(ApiError::model_not_found(requested, &self.model_name))
    }

    /// The job for a tokenised prompt: a prompt that leaves no room in the context is a 400 that
    /// says the numbers; `max_tokens` is cut to what the context has left.
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
        let room = self.max_seq - prompt.len();
        Ok(GenerationJob {
            prompt,
            turn_boundary,
            max_tokens: request.max_tokens.map_or(room, |n| n.min(room)),
            sampling: request.sampling.clone(),
            stop: request.stop.clone(),
        })
    }
}

pub fn router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .fallback(|| async { ApiError::not_found("this path").into_response() })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// The body, or the OpenAI error for why it could not be read (too large, cut off).
pub fn body_bytes(body: Result<Bytes, BytesRejection>) -> ApiResult<Bytes> {
    body.map_err(|rejection| ApiError {
        status: rejection.status(),
        ..ApiError::invalid(rejection.body_text())
    })
}

pub fn outcome_usage(outcome: &Outcome) -> Value {
    let completion = outcome.tokens.len();
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

async fn model(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match app.check_model(&id) {
        Ok(()) => Json(model_object(&app)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    if app.engine.is_alive() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        ApiError::unavailable("the generation engine has stopped").into_response()
    }
}
