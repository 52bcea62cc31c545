//! Diagnostics: an error code, a lowercase message naming the item in backticks, labelled spans and
//! notes, rendered with line, column and a source snippet by codespan-reporting.

use codespan_reporting::diagnostic::{Diagnostic as CsDiagnostic, Label};
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term::{self, Config};

use crate::ast::Span;

/// One diagnostic about a recipe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Stable error code, e.g. `E0203`.
    pub code: String,
    /// The headline.
    pub message: String,
    /// Labelled spans; the first is the primary one.
    pub labels: Vec<(Span, String)>,
    /// Further notes (help text, the binding used, ...).
    pub notes: Vec<String>,
}

impl Diagnostic {
    /// A new error.
    pub fn error(code: &str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            code: code.to_string(),
            message: message.into(),
            labels: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Add a label (the first added is primary).
    pub fn with_label(mut self, span: Span, text: impl Into<String>) -> Diagnostic {
        self.labels.push((span, text.into()));
        self
    }

    /// Add a note.
    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    /// Render with source snippets, without colour.
    pub fn render(&self, file_name: &str, src: &str) -> String {
        render_all(std::slice::from_ref(self), file_name, src)
    }

    /// Line and column (1-based) of the primary label.
    pub fn line_col(&self, src: &str) -> Option<(usize, usize)> {
        let at = self.labels.first()?.0.start.min(src.len());
        let before = src.get(..at)?;
        let line = before.matches('\n').count() + 1;
        let col = before.len() - before.rfind('\n').map(|p| p + 1).unwrap_or(0) + 1;
        Some((line, col))
    }
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "error[{}]: {}", self.code, self.message)
    }
}

/// Render several diagnostics against one source file, without colour.
pub fn render_all(diags: &[Diagnostic], file_name: &str, src: &str) -> String {
    let file = SimpleFile::new(file_name, src);
    let mut buf = String::new();
    let config = Config::default();
    for d in diags {
        let labels = d
            .labels
            .iter()
            .enumerate()
            .map(|(k, (span, text))| {
                let s = span.start.min(src.len());
                let e = span.end.clamp(s, src.len());
                if k == 0 {
                    Label::primary((), s..e).with_message(text)
                } else {
                    Label::secondary((), s..e).with_message(text)
                }
            })
            .collect();
        let cs = CsDiagnostic::error()
            .with_code(d.code.clone())
            .with_message(d.message.clone())
            .with_labels(labels)
            .with_notes(d.notes.clone());
        if term::emit_to_string(&mut buf, &config, &file, &cs).is_err() {
            return diags.iter().map(|d| format!("{d}\n")).collect::<String>();
        }
    }
    buf
}
