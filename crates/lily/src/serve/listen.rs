//! The accept loop. axum's own `serve` gives hyper no timer, which turns hyper's header-read
//! timeout off: a client that sends its headers a byte at a time would hold a connection for
//! ever. This loop is axum's, with the timer, the graceful shutdown the server needs, and a cap
//! on open connections (each is a task, buffers and a file descriptor).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::{Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use super::error::ApiError;
use super::request_id::ClientAddr;

pub struct Limits {
    /// How long a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// Connections beyond this many get a 503 at once.
    pub max_connections: usize,
    /// How long a shutdown waits for open responses.
    pub grace: Duration,
}

/// Serves `router` until `shutdown` completes; then stops accepting and returns once every open
/// connection has finished its response (true), or after `limits.grace` at the latest (false).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> bool {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    // Connections hold a receiver each: the sender says "shut down", and `closed()` says they
    // are all gone.
    let (stop, stopped) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, most likely: let some connections close.
                    eprintln!("lily: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let header_timeout = limits.header_timeout;
        let service = TowerToHyperService::new(router.clone().layer(Extension(ClientAddr(peer))));
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let mut draining = false;
            loop {
                tokio::select! {
                    _ = connection.as_mut() => break,
                    changed = stopped.changed(), if !draining => {
                        draining = true;
                        if changed.is_ok() {
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop((stopped, permit));
        });
    }
    drop(listener);
    drop(stopped);
    let _ = stop.send(true);
    tokio::time::timeout(limits.grace, stop.closed())
        .await
        .is_ok()
}

/// A 503 with OpenAI's error object, written straight to the socket (no HTTP machinery for a
/// connection we will not serve). Then the request is read (and dropped) until the client
/// closes, for a second at most: closing with it unread would reset the connection, and the
/// client might never see the answer.
async fn refuse(stream: TcpStream, max_connections: usize) {
    let body = ApiError::unavailable(format!(
        "the server has {max_connections} connections open (--max-connections); retry later"
    ))
    .body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = async {
        let mut unsent = response.as_bytes();
        while !unsent.is_empty() && stream.writable().await.is_ok() {
            match stream.try_write(unsent) {
                Ok(n) => unsent = &unsent[n..],
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return,
            }
        }
        let mut buffer = [0u8; 4096];
        while stream.readable().await.is_ok() {
            match stream.try_read(&mut buffer) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
    };
    // A client that neither reads nor closes gets a second, no more.
    let _ = tokio::time::timeout(Duration::from_secs(1), answer).await;
}
