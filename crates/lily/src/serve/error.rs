//! Every error the server answers is OpenAI's error object with a matching HTTP status, so that
//! clients raise their usual exception types.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A problem with one request field, named as clients name it (`messages[1].content`).
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        ApiError {
            message: format!("{param}: {}", message.into()),
            param: Some(param),
            ..Self::invalid("")
        }
    }

    pub fn unsupported(param: &str, what: &str) -> Self {
        ApiError {
            code: Some("unsupported_parameter"),
            ..Self::param(param, format!("{what} is not supported by this server"))
        }
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model {requested:?} does not exist; this server serves {served:?}"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn context_length(prompt_tokens: usize, context: usize) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..Self::param(
                "messages",
                format!(
                    "the prompt has {prompt_tokens} tokens, but this server's context is \
                     {context} tokens and must leave room for at least one generated token; \
                     shorten the prompt or restart the server with a larger --max-seq"
                ),
            )
        }
    }

    /// `max_tokens` more than the context leaves after the prompt.
    pub fn reply_too_long(prompt_tokens: usize, max_tokens: usize, context: usize) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..Self::param(
                "max_tokens",
                format!(
                    "this server's context is {context} tokens, but {} were requested \
                     ({prompt_tokens} in the prompt, {max_tokens} for the reply); ask for at \
                     most {} tokens, or restart the server with a larger --max-seq",
                    prompt_tokens + max_tokens,
                    context - prompt_tokens
                ),
            )
        }
    }

    pub fn queue_full(capacity: usize) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "the server is busy: {capacity} requests are already waiting; retry later"
            ),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    pub fn not_found(what: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            ..Self::invalid(format!("{what} does not exist"))
        }
    }

    pub fn method_not_allowed() -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            ..Self::invalid("this method is not allowed on this path")
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..Self::internal(message)
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
