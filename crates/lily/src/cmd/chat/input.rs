//! Where `lily chat` reads its turns: a line editor on a terminal (history, editing, a pasted
//! block of lines as one turn), or plain lines from a pipe, one turn each.

use std::io::{BufRead, IsTerminal};

use anyhow::{Context, Result};
use rustyline::DefaultEditor;
use rustyline::error::ReadlineError;

pub enum Line {
    Text(String),
    /// Ctrl-C at the prompt: the line is dropped, the conversation goes on.
    Interrupted,
    /// Ctrl-D, or the end of the input.
    End,
}

pub enum Input {
    Editor(Box<DefaultEditor>),
    Plain(std::io::Stdin),
}

impl Input {
    pub fn new() -> Result<Self> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(Input::Plain(stdin));
        }
        // Bracketed paste (on by default) hands a pasted block over as one line, newlines kept.
        let editor = DefaultEditor::new().context("starting the line editor")?;
        Ok(Input::Editor(Box::new(editor)))
    }

    pub fn read(&mut self) -> Result<Line> {
        match self {
            Input::Editor(editor) => match editor.readline("> ") {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        // A history entry that failed to be added only loses an Up arrow.
                        let _ = editor.add_history_entry(line.as_str());
                    }
                    Ok(Line::Text(line))
                }
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(ReadlineError::Eof) => Ok(Line::End),
                Err(e) => Err(e).context("reading the terminal"),
            },
            Input::Plain(stdin) => {
                eprint!("> ");
                let mut line = String::new();
                if stdin
                    .lock()
                    .read_line(&mut line)
                    .context("reading the input")?
                    == 0
                {
                    eprintln!();
                    return Ok(Line::End);
                }
                Ok(Line::Text(line.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }
}
