//! `runcell`: `runcell run` here, every other command in `runcell-full`
//! beside it. See [`runcell_cli::front_main`].

fn main() -> std::process::ExitCode {
    runcell_cli::front_main()
}
