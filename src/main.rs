//! The `foldmoe` command.

fn main() {
    let spec = foldmoe::models::tiny();
    println!("foldmoe: default model `{}`", spec.name);
}
