//! The accept loop. axum's own `serve` gives hyper no timer, which turns hyper's header-read
//! timeout off: a client that sends its headers a byte at a time would hold a connection for
//! ever. This loop is axum's, with the timer, and with the graceful shutdown the server needs.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Serves `router` until `shutdown` completes; then stops accepting and returns once every open
/// connection has finished its response (true), or after `grace` at the latest (false).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> bool {
    // Connections hold a receiver each: the sender says "shut down", and `closed()` says they
    // are all gone.
    let (stop, stopped) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
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
        let service = TowerToHyperService::new(router.clone());
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
            drop(stopped);
        });
    }
    drop(listener);
    drop(stopped);
    let _ = stop.send(true);
    tokio::time::timeout(grace, stop.closed()).await.is_ok()
}
