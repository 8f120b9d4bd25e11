//! TensorFlow's `Event` and `Summary` messages (tensorflow/core/util/event.proto and
//! framework/summary.proto), the fields TensorBoard's scalar dashboard reads. The protos put
//! `file_version` / `summary` and `simple_value` in `oneof`s; a oneof member is encoded as a
//! plain optional field, so these optional fields are wire-identical.

/// One event record: the file header (`file_version`) or a step's summary.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `Summary.Value`: a tag and its scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}
