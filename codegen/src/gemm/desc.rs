//! Placeholder, replaced by the desc work.
