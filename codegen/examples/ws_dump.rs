#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]
use moeforge_codegen::gemm::{tune, ws::*};
fn main() {
    let dir = std::env::args().nth(1).unwrap();
    for (o, s) in [(Operands::Bf16, Scaling::None), (Operands::E4m3, Scaling::Tensorwise { per_token: true }), (Operands::E4m3, Scaling::Block128)] {
        for cfg in tune::candidates(o, s, 4096, 7168) {
            let name = format!("k_{}", cfg.tag());
            std::fs::write(format!("{dir}/{name}.ptx"), grouped_ws_module(&name, &cfg).unwrap()).unwrap();
        }
    }
}
