//! ptx (todo)
