//! A handler that panics answers 500 instead of taking the daemon down.

use std::any::Any;

use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Answers a panic in a handler with a 500 `{"error": ...}` and logs it; the
/// daemon and every other request carry on.
pub(crate) type CatchPanics =
    tower_http::catch_panic::CatchPanicLayer<fn(Box<dyn Any + Send + 'static>) -> Response>;

/// The layer that catches a panicking handler (see [`CatchPanics`]).
pub(crate) fn catch_panics() -> CatchPanics {
    tower_http::catch_panic::CatchPanicLayer::custom(panic_response as fn(_) -> _)
}

fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    tracing::error!(panic = what, "a request handler panicked; answered 500");
    ApiError::internal(
        "The daemon failed while handling this request (an internal error, logged); \
         the request may be retried, and other requests are not affected.",
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use axum::Router;

    /// A router whose handler panics keeps serving: the panicking request
    /// gets a 500 with a JSON error, the next ones are answered normally.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_panicking_handler_answers_500_and_the_server_keeps_serving() {
        let app = Router::new()
            .route(
                "/boom",
                get(|| async {
                    let n: u32 = "not a number".parse().unwrap_or(0);
                    if n == 0 {
                        panic!("a handler bug");
                    }
                    "never"
                }),
            )
            .route("/ok", get(|| async { "ok" }))
            .layer(catch_panics());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        for _ in 0..3 {
            let r = client
                .get(format!("http://{addr}/boom"))
                .send()
                .await
                .expect("a panicking handler must still be answered");
            assert_eq!(r.status(), 500);
            let body: serde_json::Value = r.json().await.unwrap();
            assert!(
                body["error"].as_str().unwrap().contains("internal error"),
                "{body}"
            );
            let r = client
                .get(format!("http://{addr}/ok"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.text().await.unwrap(), "ok");
        }
    }
}
