//! `runcell-full`: every command of `runcell`. See [`runcell_cli::main`].

fn main() -> std::process::ExitCode {
    runcell_cli::main()
}
