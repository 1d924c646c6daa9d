//! Every command's `--help` shows text for every argument (issue 23: `<NAME>`,
//! `<PATH>` and `<VOLUME>` had none), and every command says what it does.
//!
//! The binary has no library target, so its argument definitions are compiled
//! into this test as they are (`cli.rs` and the error type it uses), and the
//! whole clap tree from `cli::command()` is walked: positional arguments,
//! options and flags of every command and subcommand, hidden ones included
//! (a hidden option still shows in the man pages and completions).

#[allow(dead_code)]
#[path = "../src/error.rs"]
mod error;

#[allow(dead_code)]
#[path = "../src/cli.rs"]
mod cli;

/// Each argument of `cmd` and of every command below it: `bulwark volume create --size`.
fn walk(
    cmd: &mut clap::Command,
    path: &str,
    visit: &mut dyn FnMut(&str, &clap::Command, Option<&clap::Arg>),
) {
    cmd.build();
    visit(path, cmd, None);
    for arg in cmd.get_arguments() {
        visit(path, cmd, Some(arg));
    }
    for sub in cmd.get_subcommands_mut() {
        let sub_path = format!("{path} {}", sub.get_name());
        walk(sub, &sub_path, visit);
    }
}

fn has_text(s: Option<&clap::builder::StyledStr>) -> bool {
    s.is_some_and(|h| !h.to_string().trim().is_empty())
}

#[test]
fn every_argument_of_every_command_has_help() {
    let mut missing = Vec::new();
    let mut seen = 0;
    walk(&mut cli::command(), "bulwark", &mut |path, _, arg| {
        let Some(arg) = arg else { return };
        let id = arg.get_id().as_str();
        if id == "help" || id == "version" {
            return;
        }
        seen += 1;
        if !has_text(arg.get_help()) && !has_text(arg.get_long_help()) {
            let shown = arg
                .get_long()
                .map(|l| format!("--{l}"))
                .unwrap_or_else(|| format!("<{}>", id.to_uppercase()));
            missing.push(format!("{path} {shown}"));
        }
    });
    assert!(seen > 100, "walked only {seen} arguments");
    assert!(missing.is_empty(), "arguments without help: {missing:#?}");
}

#[test]
fn every_command_says_what_it_does() {
    let mut missing = Vec::new();
    walk(&mut cli::command(), "bulwark", &mut |path, cmd, arg| {
        if arg.is_none() && !has_text(cmd.get_about()) && !has_text(cmd.get_long_about()) {
            missing.push(path.to_string());
        }
    });
    assert!(
        missing.is_empty(),
        "commands without a description: {missing:#?}"
    );
}

/// The help text printed for each command names every visible argument with its text:
/// what a user reads, not only what clap holds.
#[test]
fn rendered_help_shows_each_arguments_text() {
    let mut bad = Vec::new();
    walk(&mut cli::command(), "bulwark", &mut |path, cmd, arg| {
        let Some(arg) = arg else { return };
        if arg.is_hide_set() || arg.get_id() == "version" {
            return;
        }
        let help = cmd.clone().render_long_help().to_string();
        let text = arg
            .get_help()
            .or(arg.get_long_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        // The first words of its text, as clap wraps them (never across a line here).
        let first: String = text
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        if first.is_empty()
            || !help
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .contains(&first)
        {
            bad.push(format!("{path} {}", arg.get_id()));
        }
    });
    assert!(bad.is_empty(), "--help does not show the text of: {bad:#?}");
}
