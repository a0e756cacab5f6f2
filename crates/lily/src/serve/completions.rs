//! `POST /v1/completions`: raw text (or token ids) in, raw text out, no template; `n` choices,
//! `logprobs`, and `echo` (the prompt before the output, scored when `logprobs` is set).

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use lily_core::logprobs::TokenLogprobs;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::constrained::{GrammarJob, OutputRule, compile_grammar};
use super::engine::{EngineEvent, Finish};
use super::error::{ApiError, ApiResult};
use super::ids::{new_id, unix_time};
use super::logprobs::LogprobFormat;
use super::request::{CompletionPrompt, parse_body, parse_completion};
use super::routes::{AppState, outcome_usage, read_body};
use super::stream::{Step, StreamFormat, sse_response};
use super::worker::WorkerEvent;

pub async fn completions(State(app): State<Arc<AppState>>, body: Body) -> Response {
    handle(app, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn handle(app: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let body = parse_body(&read_body(body, &app).await?)?;
    let request = parse_completion(&body, &app.defaults)?;
    app.check_model(&request.common.model)?;
    // Output is always text, so even a prompt of token ids needs the tokenizer.
    let text = app.text.clone();
    let tokens = match request.prompt {
        CompletionPrompt::Tokens(ids) => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= app.vocab_size) {
                return Err(ApiError::param(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary of {}",
                        app.vocab_size
                    ),
                ));
            }
            ids
        }
        CompletionPrompt::Text(prompt) => {
            tokio::task::spawn_blocking(move || text.tokenizer.encode(&prompt))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))?
                .map_err(|e| ApiError::param("prompt", format!("{e:#}")))?
        }
    };
    // The prompt as its tokens decode, so that `text_offset` counts what the client gets back.
    let echo = request
        .echo
        .then(|| (tokens.clone(), app.text.tokenizer.decode(&tokens)));
    let mut job = app.job(tokens, None, &request.common, "prompt")?;
    job.logprobs = request.logprobs;
    job.prompt_logprobs = request.logprobs.filter(|_| request.echo);
    // A raw prompt opens no reasoning block: the grammar starts at the first token.
    let grammar = request.format.clone().map(|format| GrammarJob {
        rule: OutputRule::Format(format),
        tools: Vec::new(),
        parallel: false,
        thinking: false,
        format_param: "response_format",
    });
    job.grammar = compile_grammar(&app, grammar).await?;
    let events = app.engine.submit(job)?;
    let head = CompletionHead {
        id: new_id("cmpl-"),
        created: unix_time(),
        model: app.model_name.clone(),
        logprobs: request
            .logprobs
            .map(|_| LogprobFormat::new(app.text.clone(), request.tokens_as_ids)),
        echo,
        n: request.common.n,
    };
    if request.common.stream {
        let format = CompletionStream {
            head,
            include_usage: request.common.include_usage,
            prompt_logprobs: Vec::new(),
        };
        return Ok(sse_response(events, format));
    }
    collect(events, head).await
}

struct CompletionHead {
    id: String,
    created: u64,
    model: String,
    logprobs: Option<LogprobFormat>,
    /// With `echo`: the prompt's tokens and text.
    echo: Option<(Vec<u32>, String)>,
    n: usize,
}

impl CompletionHead {
    fn body(&self, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id, "object": "text_completion", "created": self.created,
            "model": self.model, "choices": choices,
        })
    }

    fn choice(index: usize, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
    }

    /// The echoed prompt's share of a choice: its text, and its tokens with their
    /// log-probabilities (none for the first, which nothing predicts).
    fn echoed<'a>(
        &'a self,
        prompt_logprobs: &'a [TokenLogprobs],
    ) -> (&'a str, Vec<u32>, Vec<Option<&'a TokenLogprobs>>) {
        let Some((tokens, text)) = &self.echo else {
            return ("", Vec::new(), Vec::new());
        };
        let mut logprobs = vec![None];
        logprobs.extend(prompt_logprobs.iter().map(Some));
        logprobs.truncate(tokens.len());
        (text, tokens.clone(), logprobs)
    }

    /// `logprobs` for generated tokens whose text starts at character `offset`, after the
    /// echoed prompt's when `with_prompt`.
    fn logprobs(
        &self,
        generated: &[TokenLogprobs],
        prompt_logprobs: &[TokenLogprobs],
        with_prompt: bool,
        offset: usize,
    ) -> Value {
        let Some(format) = &self.logprobs else {
            return Value::Null;
        };
        let (_, mut tokens, mut logprobs) = if with_prompt {
            self.echoed(prompt_logprobs)
        } else {
            ("", Vec::new(), Vec::new())
        };
        tokens.extend(generated.iter().map(|lp| lp.token));
        logprobs.extend(generated.iter().map(Some));
        format.completion(&tokens, &logprobs, offset)
    }
}

fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::Stop | Finish::Cancelled => "stop",
    }
}

#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprobs>,
}

async fn collect(
    mut events: UnboundedReceiver<WorkerEvent>,
    head: CompletionHead,
) -> ApiResult<Response> {
    let mut choices: Vec<Choice> = Vec::new();
    let mut prompt_logprobs = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            WorkerEvent::Engine(EngineEvent::Text {
                choice,
                text,
                logprobs,
            }) => {
                while choices.len() <= choice {
                    choices.push(Choice::default());
                }
                choices[choice].text.push_str(&text);
                choices[choice].logprobs.extend(logprobs);
            }
            WorkerEvent::Engine(EngineEvent::Started {
                prompt_logprobs: p, ..
            }) => prompt_logprobs = p,
            WorkerEvent::Failed(message) => return Err(ApiError::internal(message)),
            WorkerEvent::Done(outcome) => {
                let (echoed, _, _) = head.echoed(&prompt_logprobs);
                let out: Vec<Value> = (0..outcome.choices.len())
                    .map(|i| {
                        let choice = choices.get(i);
                        let generated = choice.map_or(&[][..], |c| &c.logprobs);
                        let text = format!("{echoed}{}", choice.map_or("", |c| c.text.as_str()));
                        let logprobs = head.logprobs(generated, &prompt_logprobs, true, 0);
                        let finish = outcome
                            .choices
                            .get(i)
                            .map_or(Finish::Cancelled, |c| c.finish);
                        CompletionHead::choice(i, &text, logprobs, Some(finish_reason(finish)))
                    })
                    .collect();
                let mut body = head.body(out);
                body["usage"] = outcome_usage(&outcome);
                return Ok(Json(body).into_response());
            }
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

struct CompletionStream {
    head: CompletionHead,
    include_usage: bool,
    prompt_logprobs: Vec<TokenLogprobs>,
}

impl CompletionStream {
    fn chunk(&self, choice: Value) -> Value {
        let mut chunk = self.head.body(vec![choice]);
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }
}

impl StreamFormat for CompletionStream {
    fn opening(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn on_event(&mut self, event: WorkerEvent) -> Step {
        let (chunks, done) = match event {
            // The echoed prompt opens every choice, once the prefill has scored it.
            WorkerEvent::Engine(EngineEvent::Started {
                prompt_logprobs, ..
            }) => {
                self.prompt_logprobs = prompt_logprobs;
                let chunks = match &self.head.echo {
                    None => Vec::new(),
                    Some((_, text)) => (0..self.head.n)
                        .map(|i| {
                            let lp = self.head.logprobs(&[], &self.prompt_logprobs, true, 0);
                            self.chunk(CompletionHead::choice(i, text, lp, None))
                        })
                        .collect(),
                };
                (chunks, false)
            }
            WorkerEvent::Engine(EngineEvent::Text {
                choice,
                text,
                logprobs,
            }) => {
                // Offsets in a stream count from the chunk's own text.
                let lp = self.head.logprobs(&logprobs, &[], false, 0);
                let chunk = self.chunk(CompletionHead::choice(choice, &text, lp, None));
                (vec![chunk], false)
            }
            WorkerEvent::Failed(message) => (vec![ApiError::internal(message).body()], true),
            WorkerEvent::Done(outcome) => {
                let mut chunks: Vec<Value> = outcome
                    .choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let reason = Some(finish_reason(c.finish));
                        self.chunk(CompletionHead::choice(i, "", Value::Null, reason))
                    })
                    .collect();
                if self.include_usage {
                    let mut last = self.head.body(Vec::new());
                    last["usage"] = outcome_usage(&outcome);
                    chunks.push(last);
                }
                (chunks, true)
            }
        };
        Step { chunks, done }
    }
}
