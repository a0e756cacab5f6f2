//! The conversation `lily chat` keeps, and the slash commands that change it.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value, json};

pub const HELP: &str = "\
commands:
  /help            this list
  /reset           start over (the system message stays)
  /system [TEXT]   set the system message (without TEXT: remove it)
  /think on|off    think before answering, or not
  /save FILE       write the conversation as JSON
  /load FILE       read a conversation written by /save
  /exit, /quit     leave (or Ctrl-D)
Ctrl-C stops a reply and keeps what it said; a line starting with // sends one starting with /.
A pasted block of lines is one message.";

pub struct Conversation {
    /// Messages as the chat template reads them; a system message, if any, first.
    pub messages: Vec<Value>,
    pub thinking: bool,
}

/// What a line asks for.
#[derive(Debug)]
pub enum Command {
    /// A message for the model.
    Say(String),
    Exit,
    /// Done; print this.
    Told(String),
}

impl Conversation {
    pub fn new(system: Option<&str>, thinking: bool) -> Self {
        let mut conversation = Conversation {
            messages: Vec::new(),
            thinking,
        };
        conversation.set_system(system);
        conversation
    }

    pub fn template_kwargs(&self) -> Map<String, Value> {
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), self.thinking.into());
        kwargs
    }

    fn has_system(&self) -> bool {
        self.messages.first().and_then(|m| m.get("role")) == Some(&json!("system"))
    }

    fn set_system(&mut self, system: Option<&str>) {
        if self.has_system() {
            self.messages.remove(0);
        }
        if let Some(system) = system {
            self.messages
                .insert(0, json!({"role": "system", "content": system}));
        }
    }

    /// Interprets one line: a slash command is carried out here, anything else is a message.
    pub fn command(&mut self, line: &str) -> Result<Command> {
        let trimmed = line.trim();
        if let Some(escaped) = trimmed.strip_prefix("//") {
            return Ok(Command::Say(format!("/{escaped}")));
        }
        let Some(command) = trimmed.strip_prefix('/') else {
            return Ok(Command::Say(line.trim().to_string()));
        };
        let (name, argument) = match command.split_once(char::is_whitespace) {
            Some((name, rest)) => (name, rest.trim()),
            None => (command, ""),
        };
        let told = match (name, argument) {
            ("help", _) => HELP.to_string(),
            ("exit" | "quit", _) => return Ok(Command::Exit),
            ("reset", _) => {
                self.messages.truncate(usize::from(self.has_system()));
                "(conversation cleared)".into()
            }
            ("system", "") => {
                self.set_system(None);
                "(system message removed)".into()
            }
            ("system", text) => {
                self.set_system(Some(text));
                "(system message set)".into()
            }
            ("think", "on") => {
                self.thinking = true;
                "(thinking on)".into()
            }
            ("think", "off") => {
                self.thinking = false;
                "(thinking off)".into()
            }
            ("think", _) => bail!("/think takes on or off"),
            ("save", "") | ("load", "") => bail!("/{name} needs a file name"),
            ("save", file) => {
                self.save(Path::new(file))?;
                format!("(saved {} messages to {file})", self.messages.len())
            }
            ("load", file) => {
                self.load(Path::new(file))?;
                format!("(loaded {} messages from {file})", self.messages.len())
            }
            _ => bail!("unknown command /{name}; /help lists them"),
        };
        Ok(Command::Told(told))
    }

    fn save(&self, path: &Path) -> Result<()> {
        let saved = json!({"messages": self.messages, "thinking": self.thinking});
        let text = serde_json::to_string_pretty(&saved)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
    }

    fn load(&mut self, path: &Path) -> Result<()> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let saved: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let Some(messages) = saved.get("messages").and_then(Value::as_array) else {
            bail!("{} has no \"messages\" list", path.display());
        };
        for (i, message) in messages.iter().enumerate() {
            let role = message.get("role").and_then(Value::as_str);
            if !matches!(role, Some("system" | "user" | "assistant"))
                || !message.get("content").is_some_and(Value::is_string)
            {
                bail!(
                    "{}: message {i} needs a role (system, user, assistant) and text content",
                    path.display()
                );
            }
        }
        self.messages = messages.clone();
        if let Some(thinking) = saved.get("thinking").and_then(Value::as_bool) {
            self.thinking = thinking;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn told(conversation: &mut Conversation, line: &str) -> String {
        match conversation.command(line).unwrap() {
            Command::Told(text) => text,
            _ => panic!("{line} is a command"),
        }
    }

    #[test]
    fn commands_change_the_conversation_and_messages_pass_through() {
        let mut c = Conversation::new(Some("Be brief."), true);
        assert!(
            matches!(c.command("Hello\nthere").unwrap(), Command::Say(t) if t == "Hello\nthere")
        );
        assert!(matches!(c.command("//help").unwrap(), Command::Say(t) if t == "/help"));
        assert!(told(&mut c, "/help").contains("/think on|off"));
        c.messages.push(json!({"role": "user", "content": "Hi"}));
        told(&mut c, "/system Be kind.");
        assert_eq!(c.messages[0]["content"], "Be kind.");
        assert_eq!(c.messages.len(), 2);
        told(&mut c, "/think off");
        assert_eq!(c.template_kwargs()["enable_thinking"], false);
        told(&mut c, "/reset");
        assert_eq!(
            c.messages,
            [json!({"role": "system", "content": "Be kind."})]
        );
        told(&mut c, "/system");
        assert!(c.messages.is_empty());
        assert!(matches!(c.command(" /exit ").unwrap(), Command::Exit));
        assert!(c.command("/think maybe").is_err());
        assert!(
            c.command("/frobnicate")
                .unwrap_err()
                .to_string()
                .contains("/help")
        );
    }

    #[test]
    fn save_then_load_restores_the_conversation_and_bad_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("chat.json");
        let mut c = Conversation::new(None, false);
        c.messages
            .push(json!({"role": "user", "content": "line one\nline two"}));
        c.messages
            .push(json!({"role": "assistant", "content": "ok"}));
        told(&mut c, &format!("/save {}", file.display()));
        let mut other = Conversation::new(Some("x"), true);
        told(&mut other, &format!("/load {}", file.display()));
        assert_eq!(
            (other.messages.clone(), other.thinking),
            (c.messages.clone(), false)
        );
        std::fs::write(
            &file,
            r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
        )
        .unwrap();
        assert!(other.command(&format!("/load {}", file.display())).is_err());
        assert_eq!(other.messages, c.messages, "a failed load changes nothing");
        assert!(other.command("/load /nonexistent/file.json").is_err());
        assert!(other.command("/save").is_err());
    }
}
