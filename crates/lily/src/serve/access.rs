//! Who may connect. With an API key every endpoint but `/health` wants `Authorization: Bearer
//! KEY` or Anthropic's `x-api-key: KEY` (a load balancer's probe carries no key); CORS headers go
//! only to origins the operator named, so by default a web page elsewhere cannot read the
//! server's answers.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::error::ApiError;

pub struct Access {
    pub api_key: Option<String>,
    /// Origins whose pages may call the server; `*` allows any.
    pub cors_origins: Vec<String>,
}

/// The middleware around every route and the fallbacks.
pub async fn guard(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    let allowed_origin = access.allowed_origin(request.headers());
    // A browser's preflight never carries credentials, so it is answered before the key check.
    if let Some(origin) = &allowed_origin
        && request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    {
        let mut response = StatusCode::NO_CONTENT.into_response();
        preflight_headers(response.headers_mut(), origin, request.headers());
        return response;
    }
    let mut response = if access.admits(&request) {
        next.run(request).await
    } else {
        unauthorized()
    };
    // Also on errors, so that a page can read why it was refused.
    if let Some(origin) = allowed_origin {
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.append(header::VARY, HeaderValue::from_static("origin"));
    }
    response
}

impl Access {
    fn admits(&self, request: &Request) -> bool {
        let Some(key) = &self.api_key else {
            return true;
        };
        if request.uri().path() == "/health" {
            return true;
        }
        // Anthropic's clients send the key as `x-api-key`.
        let anthropic = request.headers().get("x-api-key").map(|v| v.as_bytes());
        bearer_token(request.headers())
            .or(anthropic)
            .is_some_and(|given| same_secret(given, key.as_bytes()))
    }

    /// The value for `Access-Control-Allow-Origin`, if the request's origin may have one.
    fn allowed_origin(&self, headers: &HeaderMap) -> Option<HeaderValue> {
        let origin = headers.get(header::ORIGIN)?;
        let any = self.cors_origins.iter().any(|o| o == "*");
        if any
            || self
                .cors_origins
                .iter()
                .any(|o| o.as_bytes() == origin.as_bytes())
        {
            Some(origin.clone())
        } else {
            None
        }
    }
}

/// The token of `Authorization: Bearer TOKEN` (the scheme in any case, as RFC 7235 says).
fn bearer_token(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
}

/// Compares in time that depends on the lengths only, so that the time taken to refuse a guess
/// says nothing about how much of it was right.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    given.ct_eq(expected).into()
}

fn unauthorized() -> Response {
    let error = ApiError {
        status: StatusCode::UNAUTHORIZED,
        code: Some("invalid_api_key"),
        ..ApiError::invalid(
            "a valid API key is required: send the header `Authorization: Bearer KEY`",
        )
    };
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

fn preflight_headers(headers: &mut HeaderMap, origin: &HeaderValue, request: &HeaderMap) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    let asked = request.get(header::ACCESS_CONTROL_REQUEST_HEADERS);
    let allowed = asked
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("authorization, content-type"));
    headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allowed);
    headers.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    headers.append(header::VARY, HeaderValue::from_static("origin"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: &[u8]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let value = HeaderValue::from_bytes(authorization).expect("a valid header value");
        headers.insert(header::AUTHORIZATION, value);
        headers
    }

    #[test]
    fn bearer_tokens_are_read_in_any_case_and_nothing_else_is() {
        assert_eq!(bearer_token(&headers(b"Bearer k1")), Some(&b"k1"[..]));
        assert_eq!(bearer_token(&headers(b"bearer  k1 ")), Some(&b"k1"[..]));
        assert_eq!(bearer_token(&headers(b"Basic azE6")), None);
        assert_eq!(bearer_token(&headers(b"Bear")), None);
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }

    #[test]
    fn secrets_must_match_exactly() {
        assert!(same_secret(b"sk-1", b"sk-1"));
        assert!(!same_secret(b"sk-1", b"sk-2"));
        assert!(!same_secret(b"sk-", b"sk-1"));
        assert!(!same_secret(b"", b"sk-1"));
    }
}
