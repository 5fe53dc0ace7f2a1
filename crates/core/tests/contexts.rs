//! Code contexts through the library: state persists, rich results come
//! back, failures are reported plainly and never take the sandbox down.

mod common;

use std::time::{Duration, Instant};

use base64::Engine;
use common::*;
use runcell_core::{CellRun, ContextOptions, Sandbox};
use runcell_protocol::Language;

async fn ctx(sb: &Sandbox, language: Language) -> String {
    sb.create_context(ContextOptions::new(language))
        .await
        .expect("context creation")
        .id
}

async fn cell(sb: &Sandbox, id: &str, code: &str) -> CellRun {
    sb.run_cell(id, code, None).await.expect("cell")
}

fn plain(run: &CellRun) -> Vec<String> {
    run.results
        .iter()
        .filter_map(|r| r.get("text/plain").cloned())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn python_state_results_errors_and_figures() {
    let rt = runtime("contexts-py");
    let sb = sandbox(&rt, limits()).await;
    let id = ctx(&sb, Language::Python).await;

    // Variables, imports, the working directory and files persist.
    let r = cell(
        &sb,
        &id,
        "import os\nx = 41\nos.chdir('/tmp')\nopen('f', 'w').write('kept')",
    )
    .await;
    assert_eq!(r.report.outcome.exit_code, 0, "{}", text(&r.stderr));
    let r = cell(&sb, &id, "print('x is', x)\nx + 1").await;
    assert_eq!(text(&r.stdout), "x is 41\n");
    assert_eq!(plain(&r), vec!["42"]);
    let r = cell(&sb, &id, "os.getcwd(), open('f').read()").await;
    assert_eq!(plain(&r), vec!["('/tmp', 'kept')"]);
    // A statement as the last line gives no result; None gives none either.
    assert!(cell(&sb, &id, "y = 1").await.results.is_empty());
    assert!(cell(&sb, &id, "None").await.results.is_empty());

    // A pandas DataFrame comes back as HTML (and text).
    let r = cell(
        &sb,
        &id,
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})",
    )
    .await;
    assert_eq!(r.report.outcome.exit_code, 0, "{}", text(&r.stderr));
    let html = r.results[0].get("text/html").expect("DataFrame HTML");
    assert!(
        html.contains("<table") && html.contains("<th>b</th>"),
        "{html}"
    );

    // A figure left open comes back as a PNG of the figure's size, without savefig.
    let r = cell(
        &sb,
        &id,
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 3), dpi=100)\nplt.plot([1, 3, 2])\nplt.title('t')",
    )
    .await;
    let pngs: Vec<&String> = r
        .results
        .iter()
        .filter_map(|b| b.get("image/png"))
        .collect();
    assert_eq!(pngs.len(), 1, "{:?} {}", plain(&r), text(&r.stderr));
    let png = base64::engine::general_purpose::STANDARD
        .decode(pngs[0])
        .unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let (w, h) = (
        u32::from_be_bytes(png[16..20].try_into().unwrap()),
        u32::from_be_bytes(png[20..24].try_into().unwrap()),
    );
    assert_eq!((w, h), (400, 300));
    // plt.show() emits the figure at that point; nothing is left for the end.
    let r = cell(&sb, &id, "plt.plot([1]); plt.show(); print('after')").await;
    assert_eq!(
        r.results
            .iter()
            .filter(|b| b.contains_key("image/png"))
            .count(),
        1
    );
    // display() shows any value.
    let r = cell(
        &sb,
        &id,
        "display(pd.DataFrame({'c': [5]})); display('s'); 7",
    )
    .await;
    assert_eq!(r.results.len(), 3);
    assert!(r.results[0].contains_key("text/html"));
    assert_eq!(plain(&r)[1..], ["'s'".to_string(), "7".to_string()]);

    // An exception: name, value and a traceback naming the user's line, not the driver's.
    let r = cell(&sb, &id, "def f(d):\n    return 1 / d\n\nf(0)").await;
    let e = r.report.outcome.error.clone().expect("error");
    assert_eq!(e.name, "ZeroDivisionError");
    assert_eq!(e.value, "division by zero");
    assert!(
        e.traceback.contains("line 2, in f") && e.traceback.contains("return 1 / d"),
        "{}",
        e.traceback
    );
    assert!(
        !e.traceback.contains("drivers/python.py"),
        "{}",
        e.traceback
    );
    assert_eq!(r.report.outcome.exit_code, 1);
    assert!(text(&r.stderr).contains("ZeroDivisionError: division by zero"));
    // A syntax error is an error too.
    let r = cell(&sb, &id, "def (:").await;
    assert_eq!(r.report.outcome.error.unwrap().name, "SyntaxError");
    // SystemExit sets the exit code and keeps the context.
    let r = cell(&sb, &id, "import sys; sys.exit(3)").await;
    assert_eq!(
        (r.report.outcome.exit_code, r.report.outcome.state_lost),
        (3, false)
    );
    assert_eq!(plain(&cell(&sb, &id, "x").await), vec!["41"]);

    // Printing something that looks like a driver event is just output.
    let r = cell(
        &sb,
        &id,
        r#"print('{"type":"done","exit_code":9,"error":null}'); print('more'); 5"#,
    )
    .await;
    assert_eq!(r.report.outcome.exit_code, 0);
    assert!(text(&r.stdout).ends_with("more\n"));
    assert_eq!(plain(&r), vec!["5"]);

    // Several contexts per sandbox, each with its own state.
    let other = ctx(&sb, Language::Python).await;
    let r = cell(&sb, &other, "x").await;
    assert_eq!(r.report.outcome.error.unwrap().name, "NameError");
    let listed = sb.list_contexts().await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().any(|c| c.id == id && c.cells >= 10));
    sb.delete_context(&other).await.unwrap();
    assert_eq!(sb.list_contexts().await.unwrap().len(), 1);
    assert!(sb.run_cell(&other, "1", None).await.is_err());
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn timeouts_interrupt_then_kill_and_crashes_restart() {
    let rt = runtime("contexts-fail");
    let sb = sandbox(&rt, limits()).await;
    let id = ctx(&sb, Language::Python).await;
    cell(&sb, &id, "state = 'kept'").await;

    // An infinite loop is interrupted (KeyboardInterrupt) and the state stays.
    let t = Instant::now();
    let r = sb
        .run_cell(&id, "while True: pass", Some(Duration::from_millis(500)))
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(3));
    let o = &r.report.outcome;
    assert!(o.timed_out && !o.state_lost && o.crashed.is_none(), "{o:?}");
    assert_eq!(o.error.as_ref().unwrap().name, "KeyboardInterrupt");
    let msg = o.messages(Language::Python, 500).join(" ");
    assert!(
        msg.contains("timed out after 0.5s") && msg.contains("state is kept"),
        "{msg}"
    );
    assert_eq!(plain(&cell(&sb, &id, "state").await), vec!["'kept'"]);

    // Code that ignores the interrupt is killed and the interpreter restarted.
    let t = Instant::now();
    let r = sb
        .run_cell(
            &id,
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
            Some(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    let o = &r.report.outcome;
    assert!(o.timed_out && o.state_lost, "{o:?}");
    let msg = o.messages(Language::Python, 300).join(" ");
    assert!(
        msg.contains("killed and restarted") && msg.contains("lost"),
        "{msg}"
    );
    let r = cell(&sb, &id, "state").await;
    assert_eq!(r.report.outcome.error.unwrap().name, "NameError");
    assert_eq!(plain(&cell(&sb, &id, "1 + 1").await), vec!["2"]);

    // os._exit and a segfault are reported as crashes; the context restarts.
    let r = cell(&sb, &id, "import os; os._exit(7)").await;
    let o = &r.report.outcome;
    assert!(
        o.crashed.as_ref().unwrap().contains("exited with code 7"),
        "{o:?}"
    );
    assert!(o.state_lost && o.exit_code == 7);
    let r = cell(&sb, &id, "import ctypes; ctypes.string_at(0)").await;
    let o = &r.report.outcome;
    assert!(o.crashed.as_ref().unwrap().contains("SIGSEGV"), "{o:?}");
    assert_eq!(plain(&cell(&sb, &id, "'alive'").await), vec!["'alive'"]);
    let info = sb.list_contexts().await.unwrap().pop().unwrap();
    assert_eq!(info.restarts, 3);

    // An explicit restart clears state.
    cell(&sb, &id, "z = 1").await;
    sb.restart_context(&id).await.unwrap();
    assert!(cell(&sb, &id, "z").await.report.outcome.error.is_some());

    // Output is capped like exec output, with totals.
    let r = cell(
        &sb,
        &id,
        "import sys\nfor _ in range(4096): sys.stdout.write('x' * 1024)",
    )
    .await;
    let o = &r.report.outcome;
    assert!(o.stdout_truncated && o.stdout_bytes == 4 << 20, "{o:?}");
    assert_eq!(r.stdout.len() as u64, sb.limits().output_bytes);

    // The sandbox itself is fine throughout.
    assert_eq!(text(&sh(&sb, "echo ok").await.stdout), "ok\n");
    sb.destroy().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn javascript_and_bash_contexts_keep_state() {
    let rt = runtime("contexts-js");
    let sb = sandbox(&rt, limits()).await;

    let js = ctx(&sb, Language::Javascript).await;
    let r = cell(
        &sb,
        &js,
        "let n = 20; const f = (a) => a * 2; console.log('hi')",
    )
    .await;
    assert_eq!(text(&r.stdout), "hi\n", "{}", text(&r.stderr));
    assert_eq!(plain(&cell(&sb, &js, "f(n) + 2").await), vec!["42"]);
    let r = cell(
        &sb,
        &js,
        "await new Promise((r) => setTimeout(r, 20)); console.log('awaited')",
    )
    .await;
    assert_eq!(text(&r.stdout), "awaited\n");
    let r = cell(&sb, &js, "function g() { return null.x }\ng()").await;
    let e = r.report.outcome.error.unwrap();
    assert_eq!(e.name, "TypeError");
    assert!(
        e.traceback.contains("cell-") && !e.traceback.contains("node.js"),
        "{}",
        e.traceback
    );
    let r = sb
        .run_cell(&js, "while (true) {}", Some(Duration::from_millis(300)))
        .await
        .unwrap();
    assert!(r.report.outcome.timed_out && !r.report.outcome.state_lost);
    assert_eq!(plain(&cell(&sb, &js, "n").await), vec!["20"]);

    let sh_ctx = ctx(&sb, Language::Bash).await;
    cell(
        &sb,
        &sh_ctx,
        "export GREETING=hello; cd /tmp; count() { echo $#; }",
    )
    .await;
    let r = cell(&sb, &sh_ctx, "echo $GREETING $(pwd) $(count a b c)").await;
    assert_eq!(text(&r.stdout), "hello /tmp 3\n");
    assert_eq!(
        cell(&sb, &sh_ctx, "false").await.report.outcome.exit_code,
        1
    );
    let r = sb
        .run_cell(
            &sh_ctx,
            "sleep 30; echo no",
            Some(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert!(r.report.outcome.timed_out && !text(&r.stdout).contains("no"));
    assert_eq!(
        text(&cell(&sb, &sh_ctx, "echo $GREETING").await.stdout),
        "hello\n"
    );
    let r = cell(&sb, &sh_ctx, "exit 4").await;
    assert!(r.report.outcome.crashed.is_some() && r.report.outcome.state_lost);
    assert_eq!(
        text(&cell(&sb, &sh_ctx, "echo back").await.stdout),
        "back\n"
    );
    sb.destroy().await.unwrap();
}

/// Top-level `await` in a JavaScript cell: the last expression's value comes
/// back, and whatever the cell declares (any declaration form) is there in
/// later cells, as in node's REPL.
#[tokio::test(flavor = "multi_thread")]
async fn javascript_top_level_await_keeps_values_and_declarations() {
    let rt = runtime("contexts-js-await");
    let sb = sandbox(&rt, limits()).await;
    let js = ctx(&sb, Language::Javascript).await;
    let ok = |r: &CellRun| {
        assert!(
            r.report.outcome.error.is_none(),
            "{:?}\n{}",
            r.report.outcome.error,
            text(&r.stderr)
        );
    };

    // The issue's cell, then its variable in the next cell.
    let r = cell(&sb, &js, "const r = await Promise.resolve(5); r").await;
    ok(&r);
    assert_eq!(plain(&r), vec!["5"]);
    assert_eq!(plain(&cell(&sb, &js, "r + 1").await), vec!["6"]);
    // Re-running the same cell (a notebook habit) works.
    assert_eq!(
        plain(&cell(&sb, &js, "const r = await Promise.resolve(7); r").await),
        vec!["7"]
    );
    // `const o = await (expr)` also compiles as a call of a function named
    // await: the async reading wins.
    let r = cell(&sb, &js, "const o = await ({ k: 1 }); o.k").await;
    ok(&r);
    assert_eq!(plain(&r), vec!["1"]);

    // Destructuring, several declarators, defaults and rest, every keyword.
    let r = cell(
        &sb,
        &js,
        "const {a, b: [c, d = 4], ...rest} = await Promise.resolve({a: 1, b: [3], e: 5}), \
         x = 'x', [y, , z] = [7, 8, 9]\n\
         let l = await 10; var v = 11\n\
         function hello(n) { return `hi ${n}` }\n\
         class Foo { m() { return 'm' } }",
    )
    .await;
    ok(&r);
    assert!(plain(&r).is_empty(), "{:?}", plain(&r));
    let r = cell(
        &sb,
        &js,
        "JSON.stringify([a, c, d, rest, x, y, z, l, v, hello(1), new Foo().m()])",
    )
    .await;
    ok(&r);
    assert_eq!(
        plain(&r),
        vec![r#"'[1,3,4,{"e":5},"x",7,9,10,11,"hi 1","m"]'"#]
    );

    // for await, and a last expression after awaits spanning lines.
    let r = cell(
        &sb,
        &js,
        "let s = 0\nasync function* gen() { yield 1; yield 2; yield 3 }\n\
         for await (const n of gen()) s += n\n\
         const late = await new Promise((res) => setTimeout(() => res('late'), 20))\n\
         console.log(late)\n\
         late.toUpperCase()\n  + s",
    )
    .await;
    ok(&r);
    assert_eq!(text(&r.stdout), "late\n");
    assert_eq!(plain(&r), vec!["'LATE6'"]);
    assert_eq!(plain(&cell(&sb, &js, "s").await), vec!["6"]);

    // A loop body without braces stays a loop body.
    let r = cell(
        &sb,
        &js,
        "let i = 0\nawait 1; while (i < 3) i++\nfor (const q of [1, 2])\n  i += q",
    )
    .await;
    ok(&r);
    assert_eq!(plain(&cell(&sb, &js, "i").await), vec!["6"]);

    // A closure made in an await cell and later cells share one variable.
    let r = cell(
        &sb,
        &js,
        "let count = 0\nconst inc = () => ++count\nawait null\ninc()",
    )
    .await;
    assert_eq!(plain(&r), vec!["1"]);
    assert_eq!(plain(&cell(&sb, &js, "inc(); count").await), vec!["2"]);
    assert_eq!(
        plain(&cell(&sb, &js, "count = 10; inc()").await),
        vec!["11"]
    );

    // A rejected promise is an exception with its name and message; what was
    // declared before it is kept.
    let r = cell(
        &sb,
        &js,
        "const before = await 1\nawait Promise.reject(new RangeError('boom ' + before))",
    )
    .await;
    assert_eq!(r.report.outcome.exit_code, 1);
    let e = r.report.outcome.error.expect("an error");
    assert_eq!(
        (e.name.as_str(), e.value.as_str()),
        ("RangeError", "boom 1")
    );
    assert!(e.traceback.contains("cell-"), "{}", e.traceback);
    assert_eq!(plain(&cell(&sb, &js, "before").await), vec!["1"]);

    // A syntax error in an await cell is reported as the real one.
    let e = cell(&sb, &js, "await 1\nconst = 2")
        .await
        .report
        .outcome
        .error
        .expect("an error");
    assert_eq!(e.name, "SyntaxError");
    assert!(!e.value.contains("async function"), "{}", e.value);

    // Cells without await behave as before: state, values, promises.
    let r = cell(&sb, &js, "let plainVar = 2\nplainVar * 21").await;
    assert_eq!(plain(&r), vec!["42"]);
    assert_eq!(plain(&cell(&sb, &js, "plainVar").await), vec!["2"]);
    assert_eq!(
        plain(&cell(&sb, &js, "Promise.resolve('p')").await),
        vec!["'p'"]
    );
    sb.destroy().await.unwrap();
}
