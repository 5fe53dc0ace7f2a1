//! The files API against hostile sandbox contents, over a real daemon: FIFOs,
//! sockets and devices are refused at once instead of wedging the sandbox, a
//! slow request holds up no other, the agent's own /proc entries stay
//! hidden, writes where they cannot go answer 4xx, and the writable layer's
//! number of files is capped.

mod common;
use common::*;

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

fn enc(path: &str) -> String {
    path.replace('%', "%25").replace(' ', "%20")
}

/// GET or PUT on an fs route: (status, body, how long it took).
async fn fs(
    d: &Daemon,
    method: Method,
    route: &str,
    id: &str,
    path: &str,
) -> (u16, String, Duration) {
    let started = Instant::now();
    let mut rb = d
        .req(
            method.clone(),
            &format!("/v1/sandboxes/{id}/{route}?path={}", enc(path)),
        )
        .timeout(Duration::from_secs(20));
    if method == Method::PUT {
        rb = rb.body("hostile\n");
    }
    let r = rb
        .send()
        .await
        .unwrap_or_else(|e| panic!("{route} {path}: {e}"));
    let status = r.status().as_u16();
    (status, r.text().await.unwrap(), started.elapsed())
}

async fn ok_exec(d: &Daemon, id: &str, cmd: &str) -> Value {
    let (s, v) = d.exec(id, cmd).await;
    assert_eq!((s, &v["exit_code"]), (200, &json!(0)), "{cmd}: {v}");
    v
}

#[tokio::test]
async fn fifos_sockets_and_devices_are_refused_at_once() {
    let d = Daemon::start(&data_dir("hostile-fifo"), free_port(), &[]);
    let id = d.create(json!({})).await;
    ok_exec(
        &d,
        &id,
        "mkfifo /tmp/fifo && python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/tmp/sock\")'",
    )
    .await;
    for (path, kind) in [
        ("/tmp/fifo", "FIFO"),
        ("/tmp/sock", "socket"),
        ("/dev/null", "character device"),
        ("/dev/zero", "character device"),
    ] {
        for method in [Method::GET, Method::PUT] {
            let (status, body, took) = fs(&d, method.clone(), "fs", &id, path).await;
            assert_eq!(status, 400, "{method} {path}: {body}");
            assert!(
                body.contains(kind) && body.contains(path),
                "{method} {path}: {body}"
            );
            assert!(
                took < Duration::from_secs(1),
                "{method} {path} took {took:?}"
            );
        }
    }
    // Listing and stat of them answer, and the sandbox is usable.
    let (status, body, _) = fs(&d, Method::GET, "fs/dir", &id, "/tmp").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"fifo\"") && body.contains("\"sock\""),
        "{body}"
    );
    let (status, body, _) = fs(&d, Method::GET, "fs/stat", &id, "/tmp/fifo").await;
    assert_eq!(status, 200, "{body}");
    let v = ok_exec(&d, &id, "echo alive").await;
    assert_eq!(v["stdout"], "alive\n");
    d.delete_all().await;
}

#[tokio::test]
async fn a_slow_request_does_not_hold_up_the_others() {
    let d = Daemon::start(&data_dir("hostile-slow"), free_port(), &[]);
    let id = d.create(json!({})).await;
    ok_exec(
        &d,
        &id,
        "mkfifo /tmp/fifo && mkdir /tmp/many && cd /tmp/many && seq 60000 | xargs touch",
    )
    .await;
    // Listing 60,000 entries is slow (and too large to answer); meanwhile
    // exec, stat, write and a read of the FIFO must all be answered.
    let d = std::sync::Arc::new(d);
    let slow = {
        let (d, id) = (d.clone(), id.clone());
        tokio::spawn(async move {
            let r = fs(&d, Method::GET, "fs/dir", &id, "/tmp/many").await;
            (r, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    let (s, v) = d.exec(&id, "echo quick").await;
    assert_eq!((s, v["stdout"].as_str()), (200, Some("quick\n")), "{v}");
    let (s, body, _) = fs(&d, Method::GET, "fs/stat", &id, "/tmp/fifo").await;
    assert_eq!(s, 200, "{body}");
    let (s, body, _) = fs(&d, Method::PUT, "fs", &id, "/tmp/written.txt").await;
    assert_eq!(s, 200, "{body}");
    let (s, body, _) = fs(&d, Method::GET, "fs", &id, "/tmp/fifo").await;
    assert_eq!(s, 400, "{body}");
    let quick_done = Instant::now();
    let ((status, body, took), slow_done) = slow.await.unwrap();
    assert!(
        quick_done < slow_done,
        "the quick requests waited for the slow one ({took:?}, answered {status} {})",
        &body[..body.len().min(200)]
    );
    // Too large to list answers 413, not a dead connection.
    assert_eq!(status, 413, "{}", &body[..body.len().min(200)]);
    let v = ok_exec(&d, &id, "cat /tmp/written.txt").await;
    assert_eq!(v["stdout"], "hostile\n");
    d.delete_all().await;
}

#[tokio::test]
async fn the_agents_proc_entries_are_hidden_from_the_files_api() {
    let d = Daemon::start(&data_dir("hostile-proc"), free_port(), &[]);
    let id = d.create(json!({})).await;
    for path in [
        "/proc/1/maps",
        "/proc/1/environ",
        "/proc/1/cmdline",
        "/proc/1/status",
        "/proc/self/maps",
        "/proc/thread-self/maps",
        "/proc/1/fd/0",
        "/proc/self/fd/3",
        "/dev/fd/0",
        "/dev/stdin",
        "/proc/1/root/etc/hostname",
        "/proc/1/cwd/etc/hostname",
        "/proc/1/task/1/maps",
    ] {
        for route in ["fs", "fs/stat"] {
            let (status, body, _) = fs(&d, Method::GET, route, &id, path).await;
            assert!(
                status == 403 || status == 404,
                "{route} {path} answered {status}: {}",
                &body[..body.len().min(300)]
            );
            assert!(!body.contains("runcell-agent"), "{route} {path}: {body}");
        }
    }
    for path in [
        "/proc/1",
        "/proc/self",
        "/proc/1/fd",
        "/dev/fd",
        "/proc/1/task",
    ] {
        let (status, body, _) = fs(&d, Method::GET, "fs/dir", &id, path).await;
        assert!(
            status == 403 || status == 404,
            "dir {path} answered {status}: {}",
            &body[..body.len().min(300)]
        );
    }
    // A link the sandbox makes to them is no way around it.
    ok_exec(
        &d,
        &id,
        "ln -s /proc/1 /tmp/agent && ln -s /proc/self/fd /tmp/fds && ln -s /proc/1/fd/3 /tmp/fd3",
    )
    .await;
    // (Under gVisor the agent's fd 3 is a regular file it keeps open, its
    // pids cgroup's count: reached through a link, the files API's own
    // thread would pass gVisor's access check.)
    for path in [
        "/tmp/agent/maps",
        "/tmp/fds/0",
        "/tmp/agent/fd/3",
        "/tmp/fd3",
    ] {
        let (status, body, _) = fs(&d, Method::GET, "fs", &id, path).await;
        assert!(status == 403 || status == 404, "{path}: {status} {body}");
    }
    // The sandbox user's own processes stay readable, and so does the rest of /proc.
    let (_, v) = d
        .exec_json(
            &id,
            json!({"cmd": "sleep 100 & echo $!", "background": true}),
        )
        .await;
    let pid = v["stdout"].as_str().unwrap().trim().to_string();
    let (status, body, _) = fs(&d, Method::GET, "fs", &id, &format!("/proc/{pid}/cmdline")).await;
    assert_eq!(status, 200, "{v} {body}");
    assert!(body.starts_with("sleep"), "{body}");
    let (status, body, _) = fs(&d, Method::GET, "fs", &id, "/proc/meminfo").await;
    assert_eq!(status, 200, "{body}");
    d.delete_all().await;
}

#[tokio::test]
async fn writes_where_they_cannot_go_answer_4xx() {
    let d = Daemon::start(&data_dir("hostile-write"), free_port(), &[]);
    let id = d.create(json!({})).await;
    ok_exec(&d, &id, "mkfifo /tmp/fifo; touch /tmp/file").await;
    for (path, want) in [
        ("/usr/bin/runcell-x", 403),
        ("/usr/x/y", 403),
        ("/proc/1/comm", 403),
        ("/proc/1/mem", 403),
        ("/proc/sys/kernel/hostname", 403),
        ("/proc/version", 403),
        ("/proc/nonexistent/x", 404),
        ("/sys/kernel/x", 403),
        ("/tmp", 400),
        ("/tmp/fifo", 400),
        ("/tmp/file/x", 400),
        ("/dev/null", 400),
    ] {
        let (status, body, _) = fs(&d, Method::PUT, "fs", &id, path).await;
        // gVisor's own procfs answers EACCES where Linux says ENOENT.
        let want = if path == "/proc/nonexistent/x"
            && std::env::var("RUNCELL_TEST_ISOLATION").as_deref() == Ok("gvisor")
        {
            403
        } else {
            want
        };
        assert_eq!(status, want, "PUT {path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"].as_str().unwrap().contains(path), "{body}");
    }
    d.delete_all().await;
}

#[tokio::test]
async fn the_number_of_files_is_capped_and_the_sandbox_recovers() {
    let d = Daemon::start(&data_dir("hostile-inodes"), free_port(), &[]);
    // 128 MiB of disk allows 32,768 files; memory is far from exhausted by them.
    let id = d
        .create(json!({"limits": {"disk_mb": 128, "memory_mb": 256}}))
        .await;
    let (_, v) = d.exec_json(&id, json!({"cmd": "mkdir /tmp/m && cd /tmp/m && python3 -c '\nn = 0\ntry:\n    while n < 60000:\n        open(str(n), \"w\").close()\n        n += 1\nexcept OSError as e:\n    print(n, e)\n'", "timeout_seconds": 120})).await;
    let out = v["stdout"].as_str().unwrap();
    assert!(out.contains("No space left on device"), "{v}");
    let made: u64 = out.split_whitespace().next().unwrap().parse().unwrap();
    assert!((30_000..33_000).contains(&made), "{made} files made: {v}");
    assert_eq!(v["oom_killed"], false, "{v}");
    let messages = v["messages"].to_string();
    assert!(messages.contains("as many files as its disk allows"), "{v}");
    // The files API says so too, by status.
    let (status, body, _) = fs(&d, Method::PUT, "fs", &id, "/tmp/one-more").await;
    assert_eq!(status, 507, "{body}");
    // Removing them works (it was OOM-killed every time before the cap).
    let v = ok_exec(&d, &id, "rm -rf /tmp/m && touch /tmp/again && echo ok").await;
    assert_eq!(v["stdout"], "ok\n", "{v}");
    assert_eq!(v["oom_killed"], false, "{v}");
    d.delete_all().await;
}
