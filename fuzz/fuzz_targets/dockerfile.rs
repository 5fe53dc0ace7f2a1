//! Any recipe text is parsed or refused with a line number; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|src: &str| {
    if let Ok(steps) = runcell_core::build::dockerfile::parse(src) {
        for s in steps {
            if let runcell_core::build::dockerfile::Instruction::Run(r) = s.instruction {
                let _ = r.argv();
            }
        }
    }
});
