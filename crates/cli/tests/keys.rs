//! `runcell serve` over real HTTP: workspaces see only their own sandboxes,
//! and keys made with `runcell key` can be listed and revoked. Needs root.

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread")]
async fn workspaces_only_see_their_own_sandboxes_and_keys_can_be_revoked() {
    let data = data_dir("ws");
    let d = Daemon::start(&data, free_port(), &[]);
    let key_cmd = |args: &[&str]| common::key_cmd(&data, args);
    let other_key = key_cmd(&["create", "--workspace", "team-b", "--name", "test"])
        .trim()
        .to_string();
    assert!(other_key.starts_with("rc_"));
    // The database never holds the key itself.
    let db = std::fs::read(data.join("registry.db")).unwrap();
    assert!(!String::from_utf8_lossy(&db).contains(&other_key[3..]));
    let other = |method: reqwest::Method, path: &str| d.req_as(&other_key, method, path);
    let mine = d
        .create(json!({"metadata": {"workspace": "team-b", "kind": "x", "threadId": "t"}}))
        .await;
    // Reserved metadata is stamped by the server.
    let got: Value = d.get(&format!("/v1/sandboxes/{mine}")).await;
    assert_eq!(got["metadata"]["workspace"], "default");
    assert!(got["metadata"].get("kind").is_none());
    assert_eq!(got["metadata"]["threadId"], "t");
    // Another workspace sees nothing of it.
    for (m, p) in [
        (reqwest::Method::GET, format!("/v1/sandboxes/{mine}")),
        (reqwest::Method::DELETE, format!("/v1/sandboxes/{mine}")),
        (
            reqwest::Method::GET,
            format!("/v1/sandboxes/{mine}/fs?path=/etc/passwd"),
        ),
    ] {
        let r = other(m, &p).send().await.unwrap();
        assert_eq!(r.status(), 404, "{p}");
    }
    let r = other(reqwest::Method::POST, &format!("/v1/sandboxes/{mine}/exec"))
        .json(&json!({"cmd": "true"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let list: Vec<Value> = d.get_as(&other_key, "/v1/sandboxes").await;
    assert!(list.is_empty(), "{list:?}");
    let me: Value = d.get_as(&other_key, "/v1/me").await;
    assert_eq!(me["user_id"], "team-b");
    // The owner still has it.
    let (s, _) = d.exec(&mine, "true").await;
    assert_eq!(s, 200);
    // Revoked keys stop working at once.
    let listing = key_cmd(&["ls"]);
    assert!(
        listing.contains("team-b") && listing.contains(&other_key[..11]),
        "{listing}"
    );
    key_cmd(&["revoke", &other_key[..11]]);
    let r = other(reqwest::Method::GET, "/v1/sandboxes")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    d.delete_all().await;
    drop(d);
    let _ = std::fs::remove_dir_all(&data);
}
