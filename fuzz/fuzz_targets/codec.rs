//! Whatever bytes come over an agent socket, reading frames answers frames
//! or an error and never panics; every frame read writes back identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use runcell_protocol::{read_frame, write_frame, Frame};

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        let mut rd = data;
        while let Ok(Some(frame)) = read_frame::<serde_json::Value, _>(&mut rd).await {
            let mut buf = Vec::new();
            write_frame(&mut buf, &frame)
                .await
                .expect("a frame read can be written");
            let back: Frame<serde_json::Value> = read_frame(&mut &buf[..])
                .await
                .expect("a frame written can be read")
                .expect("one frame");
            assert_eq!(back, frame);
        }
    });
});
