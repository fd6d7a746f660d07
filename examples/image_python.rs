//! A sandbox from an OCI image: the image's own Python and packages (numpy, which the host
//! need not have), a file in, a file out.
//!
//! ```sh
//! cargo run -p agent-sandbox --example image_python -- IMAGE
//! ```
//!
//! IMAGE is any reference `agent-sandbox image pull` takes with a `python3` (default
//! `python:3.12-slim` from Docker Hub, which has no numpy: the code says so and uses
//! `statistics`). CI runs it with the Debian 13 image
//! `scripts/test-image.sh` builds: `oci:/var/tmp/agent-sandbox-images/trixie-numpy:python3`.

use agent_sandbox::{ExecRequest, Language, Question, Runtime, SandboxSpec, TierChoice};

const CODE: &str = r#"
import csv, json, platform, statistics
rows = [float(v) for row in csv.reader(open('/workspace/samples.csv')) for v in row]
try:
    import numpy as np
    summary = {'mean': round(float(np.mean(rows)), 3), 'std': round(float(np.std(rows)), 3)}
    extra = 'numpy ' + np.__version__
except ImportError:
    summary = {'mean': round(statistics.fmean(rows), 3), 'std': round(statistics.pstdev(rows), 3)}
    extra = 'no numpy in this image (statistics instead)'
open('/workspace/summary.json', 'w').write(json.dumps(summary))
print('python', platform.python_version(), 'on',
      platform.freedesktop_os_release().get('PRETTY_NAME'), '-', extra)
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let image = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "python:3.12-slim".to_owned());
    let rt = Runtime::new();
    let spec = SandboxSpec::builder(Language::Python)
        .image(&image)
        .memory_mib(512)
        .build()?;
    // Auto picks a tier that can start images (gVisor for untrusted code, else the container
    // tier when weaker isolation is allowed).
    let q = Question::new(Language::Python).allow_weaker_isolation(true);
    let sandbox = rt.create(&spec, TierChoice::Auto(q)).await?;
    println!("image {image} on the {} tier", sandbox.tier());

    sandbox
        .write_file("samples.csv", b"1.5,2.5,3.5\n4.5,5.5,6.5\n")
        .await?;
    let out = sandbox.exec(ExecRequest::code(CODE)).await?;
    print!("{}", out.stdout_str());
    if !out.success() {
        eprint!("{}", out.stderr_str());
        return Err(format!("the code failed (exit {:?})", out.exit_code).into());
    }
    let summary = sandbox.read_file("summary.json").await?;
    println!("summary.json: {}", String::from_utf8_lossy(&summary));
    sandbox.destroy().await?;
    Ok(())
}
