//! The `foldmoe` command: the CLI over the shipped models.

fn main() {
    foldmoe::cli::main(foldmoe::models::registry())
}
