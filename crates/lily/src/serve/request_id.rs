//! Which request a log line is about. Each request gets an id as it arrives (the request line
//! logs it with the client's address, and the response carries it as `x-request-id`); the
//! handler runs inside its scope, so that the engine's lines about the generation it submits
//! (the outcome, a failure) carry the same id, however many generations run at once.

use std::net::SocketAddr;

use super::ids::new_id;

tokio::task_local! {
    static REQUEST_ID: String;
}

/// The peer of a connection, which the accept loop attaches to each of its requests.
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub SocketAddr);

/// A new request id.
pub fn new_request_id() -> String {
    new_id("req_")
}

/// Runs `work` as the request `id`.
pub async fn scoped<F: Future>(id: String, work: F) -> F::Output {
    REQUEST_ID.scope(id, work).await
}

/// The id of the request being handled, or a fresh one outside any (a direct engine caller).
pub fn current_request_id() -> String {
    REQUEST_ID
        .try_with(String::clone)
        .unwrap_or_else(|_| new_request_id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_id_is_the_scope_s_inside_it_and_fresh_outside() {
        let inside = scoped("req_a".into(), async { current_request_id() }).await;
        assert_eq!(inside, "req_a");
        let (a, b) = (current_request_id(), current_request_id());
        assert!(a.starts_with("req_") && a != b && a != "req_a");
    }
}
